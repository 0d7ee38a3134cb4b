//! `IDEM_REQUIRE_TOKEN` and `IDEM_TOKEN_TTL` (alone in their own test
//! binary: they set process-wide environment variables that other tests
//! must not see).

mod common;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use common::*;
use idem_core::MemoryStore;
use idem_gateway::{ConfigError, GatewayArgs, GatewayConfig};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    g: GatewayArgs,
}

fn parse(upstream: &str, args: &[&str]) -> Result<GatewayConfig, ConfigError> {
    let mut v = vec![
        "idem",
        "--upstream",
        upstream,
        "--store",
        "memory://",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "off",
    ];
    v.extend_from_slice(args);
    Cli::try_parse_from(v).unwrap().g.into_config()
}

#[tokio::test]
async fn require_token_comes_from_a_comma_separated_idem_require_token() {
    let up = upstream().await;
    std::env::set_var("IDEM_REQUIRE_TOKEN", "/orders, /refunds/");
    std::env::set_var("IDEM_TOKEN_TTL", "10m");
    let config = parse(&up.url(), &[]).unwrap();
    assert_eq!(config.layer.require_token, vec!["/orders", "/refunds/"]);
    assert_eq!(config.layer.token_ttl, Duration::from_secs(600));
    // The flag wins over the variable.
    assert_eq!(
        parse(&up.url(), &["--require-token", "/pay"])
            .unwrap()
            .layer
            .require_token,
        vec!["/pay"]
    );
    std::env::set_var("IDEM_REQUIRE_TOKEN", "orders");
    assert!(matches!(
        parse(&up.url(), &[]),
        Err(ConfigError::RequireToken(_))
    ));
    std::env::remove_var("IDEM_REQUIRE_TOKEN");
    std::env::remove_var("IDEM_TOKEN_TTL");
    assert!(parse(&up.url(), &[])
        .unwrap()
        .layer
        .require_token
        .is_empty());

    // The configuration from the variable, served for real.
    let gw = gateway_with(config, Arc::new(MemoryStore::new())).await;
    let c = client();
    let r = post(&c, &gw.url("/orders"), None, "{}").await;
    assert_eq!(r.status, 428, "{}", r.text());
    let r = post(&c, &gw.url("/orders"), Some(&key("plain")), "{}").await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.problem_type(), "urn:idem:problem:token-unknown");
    assert_eq!(up.hits(), 0);
    let issued = read(
        c.post(gw.url("/_idem/tokens"))
            .header("authorization", "Bearer alice")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(issued.status, 201);
    assert_eq!(issued.json()["expires_in"], 600);
    let t = issued.json()["token"].as_str().unwrap().to_owned();
    let r = read(
        c.post(gw.url("/orders"))
            .header("authorization", "Bearer alice")
            .header("idempotency-key", &t)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = post(&c, &gw.url("/refunds"), Some(&key("r")), "{}").await;
    assert_eq!(r.status, 201, "`/refunds/` covers only paths under it");
    assert_eq!(up.hits(), 2);
    token_budget_variables();
}

/// Run by the test above, not beside it: both set process-wide variables.
fn token_budget_variables() {
    std::env::set_var("IDEM_ISSUE_TOKENS", "yes");
    std::env::set_var("IDEM_ANONYMOUS_TOKENS", "on");
    std::env::set_var("IDEM_TOKENS_PER_SCOPE", "9");
    std::env::set_var("IDEM_MAX_LIVE_TOKENS", "90");
    let c = parse("http://127.0.0.1:9", &[]);
    std::env::remove_var("IDEM_ISSUE_TOKENS");
    std::env::remove_var("IDEM_ANONYMOUS_TOKENS");
    std::env::remove_var("IDEM_TOKENS_PER_SCOPE");
    std::env::remove_var("IDEM_MAX_LIVE_TOKENS");
    let c = c.unwrap();
    assert!(c.issue_tokens && c.tokens_served());
    assert!(c.layer.anonymous_tokens);
    assert_eq!((c.layer.tokens_per_scope, c.layer.max_live_tokens), (9, 90));
}
