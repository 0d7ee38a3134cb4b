//! The example configuration file of `idem gateway --config`,
//! [`idem.toml`](https://example.invalid/idem/examples/config/idem.toml):
//! one gateway with three routes (payments: key required, 24 h TTL, 60 s
//! lease; carts: passed through; webhooks: the key from the body's
//! `/event_id`, `/delivered_at` left out of the fingerprint).
//!
//! The file is the example; this crate only keeps it in the workspace (every
//! directory under `examples/` is a crate) and exposes its text. Run it with
//! `idem gateway --config examples/config/idem.toml`, check it with
//! `idem config check examples/config/idem.toml`;
//! `crates/idem-cli/tests/routes.rs` does both.

/// The text of `examples/config/idem.toml` (TOML 1.0).
pub const IDEM_TOML: &str = include_str!("../idem.toml");
