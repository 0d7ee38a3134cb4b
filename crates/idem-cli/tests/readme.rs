//! Keeps README.md true: its configuration table lists exactly the flags
//! and environment variables `idem gateway --help` shows, and its quick
//! start names the two commands (the demo and the test script).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

fn readme() -> String {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "..", "README.md"]
        .iter()
        .collect();
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The lines of the README section that starts with `heading`, up to the
/// next heading of the same or a higher level.
fn section<'a>(text: &'a str, heading: &str) -> Vec<&'a str> {
    let level = heading.chars().take_while(|c| *c == '#').count();
    let mut lines = text.lines().skip_while(|l| l.trim_end() != heading);
    assert!(lines.next().is_some(), "README has no {heading:?} section");
    lines
        .take_while(|l| {
            let hashes = l.chars().take_while(|c| *c == '#').count();
            !(hashes > 0 && hashes <= level && l[hashes..].starts_with(' '))
        })
        .collect()
}

/// Long flags and environment variables in `idem gateway --help`.
fn gateway_help() -> (BTreeSet<String>, BTreeSet<String>) {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["gateway", "--help"])
        .env_remove("IDEM_LOG_FORMAT")
        .output()
        .expect("run idem gateway --help");
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let mut flags = BTreeSet::new();
    let mut envs = BTreeSet::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("--") {
            let flag = t.split_whitespace().next().unwrap_or_default();
            if flag != "--help" {
                flags.insert(flag.to_owned());
            }
        }
        if let Some(rest) = t.strip_prefix("[env: ") {
            let name: String = rest
                .chars()
                .take_while(|c| *c != '=' && *c != ']')
                .collect();
            envs.insert(name);
        }
    }
    assert!(
        flags.contains("--upstream"),
        "unexpected help text:\n{text}"
    );
    (flags, envs)
}

#[test]
fn configuration_table_matches_the_gateway_flags() {
    let text = readme();
    let rows: Vec<&str> = section(&text, "### Configuration")
        .into_iter()
        .filter(|l| l.starts_with("| `--"))
        .collect();
    let mut table_flags = BTreeSet::new();
    let mut table_envs = BTreeSet::new();
    for row in &rows {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        // cells[0] is empty (the line starts with '|').
        let flag = cells[1].trim_matches('`');
        let flag = flag.split_whitespace().next().unwrap_or_default();
        table_flags.insert(flag.to_owned());
        table_envs.insert(cells[2].trim_matches('`').to_owned());
    }
    let (flags, envs) = gateway_help();
    assert_eq!(
        table_flags, flags,
        "README's configuration table (left) and `idem gateway --help` (right) list different flags"
    );
    assert_eq!(
        table_envs, envs,
        "README's configuration table (left) and `idem gateway --help` (right) list different variables"
    );
}

#[test]
fn quick_start_has_the_two_commands() {
    let text = readme();
    let lines = section(&text, "## Quick start");
    // Commands are the lines of the ```sh blocks (```text blocks show output).
    let mut commands = Vec::new();
    let mut block: Option<&str> = None;
    for l in lines {
        if let Some(fence) = l.strip_prefix("```") {
            block = match block {
                Some(_) => None,
                None => Some(fence.trim()),
            };
        } else if block == Some("sh") && !l.trim().is_empty() {
            commands.push(l.trim());
        }
    }
    assert_eq!(
        commands,
        ["cargo run --release -- demo", "./scripts/test.sh"],
        "the quick start must hold exactly the demo and the test command"
    );
    let ci: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "..", ".ci", "run"]
        .iter()
        .collect();
    let ci = std::fs::read_to_string(ci).expect("read .ci/run");
    assert!(
        ci.contains("./scripts/test.sh"),
        ".ci/run must run the README's test command"
    );
}
