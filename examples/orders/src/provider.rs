//! A simulated payment provider, in the service's database but standing
//! for a remote system: it keeps its own ledger (`provider_charges`, with a
//! UNIQUE provider idempotency key) and charges at most once per key.
//!
//! It is also a *fenced resource*: every call carries the caller's lock
//! fence, and the provider refuses a call whose fence is lower than the
//! highest it has seen for the order (`provider_fences`), so a lock holder
//! paused past its lease cannot write to the ledger after a newer holder.

use std::time::Duration;

use serde::Serialize;
use sqlx::{FromRow, Row};

use crate::db::{now_ms, with_tx, Db};
use crate::{Error, Result};

/// How long a `slow` call takes before it answers.
pub const SLOW_DELAY: Duration = Duration::from_millis(1500);

/// How one call to the provider behaves (request header `X-Simulate`).
/// Applies when the call makes a *new* attempt (a provider key not seen
/// before); a repeated key always gets the stored outcome, at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Simulate {
    /// Charge and answer.
    #[default]
    Normal,
    /// Decline (no charge); the decline is stored under the key.
    Fail,
    /// Wait [`SLOW_DELAY`], then charge and answer.
    Slow,
    /// Charge, but the answer never reaches the caller (it times out and
    /// cannot know whether the charge happened).
    LoseResponse,
}

impl Simulate {
    /// Parses the `X-Simulate` value (`fail`, `slow`, `lose-response`,
    /// case-insensitive; empty or `none` = normal).
    ///
    /// # Errors
    /// The unknown value, for a 400.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" => Ok(Self::Normal),
            "fail" => Ok(Self::Fail),
            "slow" => Ok(Self::Slow),
            "lose-response" => Ok(Self::LoseResponse),
            other => Err(format!(
                "unknown X-Simulate value {other:?}: expected fail, slow or lose-response"
            )),
        }
    }
}

/// One entry of the provider's ledger: a charge; decoded from its row by column name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Charge {
    /// Ledger row id.
    pub id: i64,
    /// The order charged.
    pub order_id: i64,
    /// Amount in cents.
    pub amount_cents: i64,
    /// The provider idempotency key (`order-{id}-attempt-{n}`).
    pub provider_key: String,
    /// The lock fence of the call that made the charge.
    pub fence: i64,
    /// When, ms since the Unix epoch.
    pub created_at: i64,
}

/// The provider's answer to a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// Charged (now, or earlier under the same key).
    Charged {
        /// The charge.
        charge: Charge,
        /// `false` when the key had been charged before (a repeat).
        new: bool,
    },
    /// Declined (now, or earlier under the same key); nothing charged.
    Declined,
    /// The call's fence is lower than one the provider has already seen
    /// for this order: a stale lock holder; nothing written.
    StaleFence {
        /// The highest fence seen for the order.
        current: i64,
    },
}

/// The provider key of an order's payment attempt.
pub fn provider_key(order_id: i64, attempt: i64) -> String {
    format!("order-{order_id}-attempt-{attempt}")
}

/// The simulated provider.
#[derive(Debug, Clone)]
pub struct Provider {
    db: Db,
}

const CHARGE_COLUMNS: &str = "id, order_id, amount_cents, provider_key, fence, created_at";

impl Provider {
    /// The provider on `db` (tables made by [`Db::migrate`]).
    pub fn new(db: Db) -> Self {
        Self { db }
    }

    /// Charges `amount_cents` for `order_id` under `key`, at most once per
    /// key, if `fence` is not lower than the highest fence seen for the
    /// order. In one transaction: raise the order's fence record (`INSERT …
    /// ON CONFLICT DO UPDATE … WHERE fence <= $new`, nothing → stale), look
    /// the key up (a repeat gets the stored outcome), else write the new
    /// outcome. `LoseResponse` commits the charge and then never returns —
    /// callers must bound the call with a timeout.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn charge(
        &self,
        order_id: i64,
        amount_cents: i64,
        key: &str,
        fence: i64,
        simulate: Simulate,
    ) -> Result<ChargeOutcome> {
        if simulate == Simulate::Slow && !self.has_key(key).await? {
            tokio::time::sleep(SLOW_DELAY).await;
        }
        let select = format!(
            "SELECT {CHARGE_COLUMNS}, outcome FROM provider_charges WHERE provider_key = $1"
        );
        let insert = format!(
            "INSERT INTO provider_charges (order_id, amount_cents, provider_key, outcome, fence, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6) RETURNING {CHARGE_COLUMNS}, outcome"
        );
        let outcome: ChargeOutcome = with_tx!(&self.db, tx => {
            let gate: Option<i64> = sqlx::query_scalar(
                "INSERT INTO provider_fences (order_id, fence) VALUES ($1, $2) \
                 ON CONFLICT (order_id) DO UPDATE SET fence = excluded.fence \
                 WHERE provider_fences.fence <= excluded.fence RETURNING fence",
            )
            .bind(order_id)
            .bind(fence)
            .fetch_optional(&mut *tx)
            .await?;
            if gate.is_none() {
                let current: i64 =
                    sqlx::query_scalar("SELECT fence FROM provider_fences WHERE order_id = $1")
                        .bind(order_id)
                        .fetch_one(&mut *tx)
                        .await?;
                Ok::<_, Error>(ChargeOutcome::StaleFence { current })
            } else if let Some(row) = sqlx::query(&select).bind(key).fetch_optional(&mut *tx).await? {
                let outcome: String = row.try_get("outcome")?;
                if outcome == "charged" {
                    Ok(ChargeOutcome::Charged { charge: Charge::from_row(&row)?, new: false })
                } else {
                    Ok(ChargeOutcome::Declined)
                }
            } else {
                let outcome = if simulate == Simulate::Fail { "declined" } else { "charged" };
                let row = sqlx::query(&insert)
                    .bind(order_id)
                    .bind(amount_cents)
                    .bind(key)
                    .bind(outcome)
                    .bind(fence)
                    .bind(now_ms())
                    .fetch_one(&mut *tx)
                    .await?;
                if outcome == "charged" {
                    Ok(ChargeOutcome::Charged { charge: Charge::from_row(&row)?, new: true })
                } else {
                    Ok(ChargeOutcome::Declined)
                }
            }
        })?;
        if simulate == Simulate::LoseResponse
            && matches!(outcome, ChargeOutcome::Charged { new: true, .. })
        {
            // The charge is committed; its answer is lost on the way back.
            std::future::pending::<()>().await;
        }
        Ok(outcome)
    }

    async fn has_key(&self, key: &str) -> Result<bool> {
        let db = &self.db;
        crate::db::with_conn!(db, conn => {
            let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM provider_charges WHERE provider_key = $1")
                .bind(key)
                .fetch_one(&mut *conn)
                .await?;
            Ok(n > 0)
        })
    }

    /// The ledger of `order_id`: its charges (declines are not charges),
    /// oldest first.
    ///
    /// # Errors
    /// [`Error::Database`].
    pub async fn charges(&self, order_id: i64) -> Result<Vec<Charge>> {
        let sql = format!(
            "SELECT {CHARGE_COLUMNS} FROM provider_charges \
             WHERE order_id = $1 AND outcome = 'charged' ORDER BY id"
        );
        let db = &self.db;
        crate::db::with_conn!(db, conn => {
            let rows = sqlx::query(&sql).bind(order_id).fetch_all(&mut *conn).await?;
            rows.iter().map(|r| Ok(Charge::from_row(r)?)).collect()
        })
    }
}
