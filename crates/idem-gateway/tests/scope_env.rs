//! `IDEM_SCOPE_HEADER` (alone in its own test binary: it sets a process-wide
//! environment variable that other tests must not see).

use clap::Parser;
use idem_gateway::{ConfigError, GatewayArgs};
use idem_http::ScopeBy;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    g: GatewayArgs,
}

fn scope_names(args: &[&str]) -> Result<Vec<String>, ConfigError> {
    let mut v = vec!["idem", "--upstream", "http://x:1", "--store", "memory://"];
    v.extend_from_slice(args);
    let c = Cli::try_parse_from(v).unwrap().g.into_config()?;
    match c.layer.scope {
        ScopeBy::Headers(names) => Ok(names.iter().map(ToString::to_string).collect()),
        other => panic!("not a header scope: {other:?}"),
    }
}

#[test]
fn scope_header_comes_from_idem_scope_header() {
    std::env::set_var("IDEM_SCOPE_HEADER", "X-Api-Key,x-tenant");
    assert_eq!(scope_names(&[]).unwrap(), vec!["x-api-key", "x-tenant"]);
    // The flag wins over the variable.
    assert_eq!(
        scope_names(&["--scope-header", "authorization"]).unwrap(),
        vec!["authorization"]
    );
    std::env::set_var("IDEM_SCOPE_HEADER", "bad name");
    assert!(matches!(scope_names(&[]), Err(ConfigError::ScopeHeader(_))));
    std::env::remove_var("IDEM_SCOPE_HEADER");
    assert_eq!(scope_names(&[]).unwrap(), vec!["authorization"]);
}
