//! The configuration file of `idem gateway --config FILE` (TOML 1.0,
//! docs/CONFIG.md): layering, per-route rules, the report of
//! `idem config check` and the JSON Schema of `idem config schema`.
//!
//! # Keys
//! The top-level keys are the flags of [`GatewayArgs`] by their long name
//! with `-` written `_`, read from clap's own definition ([`file_keys`]), so
//! a new flag has its key at once: `upstream = "http://127.0.0.1:3000"`,
//! `ttl = "24h"`, `require_key = true`, `scope_header = ["x-api-key"]`. A
//! boolean flag takes `true` or `false`; a repeatable flag an array of
//! strings (or one string, split at commas like the flag); any other a
//! string, or an integer where the flag takes a number or a byte size.
//! Each value goes through the flag's own parser, so it is checked exactly
//! as on the command line. `[[routes]]` tables hold per-route rules
//! ([`ROUTE_KEYS`]).
//!
//! # Precedence
//! A flag on the command line wins over its `IDEM_*` variable, which wins
//! over the file, which wins over the default. Each route starts from the
//! effective top-level settings (after that layering) and changes what it
//! names.
//!
//! # Errors
//! Unknown keys, values of the wrong type and values a parser refuses are
//! [`LoadError::At`] with the file's line and column (1-based).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, Command, FromArgMatches};
use http::HeaderName;
use idem_core::RedactedUrl;
use idem_http::fingerprint::FingerprintSpec;
use idem_http::{Disposition, KeySource, Options, Route, RouteError, ScopeBy, StatusPolicy};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::{
    parse_duration, parse_method, parse_scope_header, parse_size, show_duration, show_scope,
    show_size, ConfigError, GatewayArgs, GatewayConfig,
};

/// The id (and long name) of the `--config` flag; it has no file key.
pub const CONFIG_ARG: &str = "config";
/// The file key of `idem --log-format` (a flag of `idem` itself, not of
/// `idem gateway`): `"text"` or `"json"`; the flag and `IDEM_LOG_FORMAT`
/// win over it. Read at start only (the logger is installed once).
pub const LOG_FORMAT_KEY: &str = "log_format";

/// How a flag's value is written in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyKind {
    /// A boolean flag (`--require-key`): `true` sets it, `false` leaves it off.
    Flag,
    /// A repeatable flag (`--scope-header`): an array of strings, or one
    /// string split at commas.
    List,
    /// A flag with one value: a string, or an integer for a number or a
    /// byte size.
    One,
}

/// One top-level key of the file: a flag of [`GatewayArgs`].
#[derive(Debug, Clone)]
pub struct FileKey {
    /// The key: the flag's long name with `-` written `_` (`scope_header`).
    pub key: String,
    /// The flag's long name (`scope-header`).
    pub long: String,
    /// clap's id of the argument.
    pub id: String,
    /// Its environment variable (`IDEM_SCOPE_HEADER`).
    pub env: Option<String>,
    /// How it is written.
    pub kind: KeyKind,
    /// clap's value name (`DURATION`, `BYTES`, `N`, `URL`), if any.
    pub value_name: Option<String>,
    /// The help text of the flag.
    pub help: String,
    /// The default values as `--help` shows them.
    pub default: Vec<String>,
}

/// The command `idem gateway` parses: [`GatewayArgs`] on their own.
pub fn gateway_command() -> Command {
    GatewayArgs::augment_args(Command::new("idem-gateway"))
}

/// Every top-level key of the file, in the order of `--help` (without
/// `--config` itself).
pub fn file_keys() -> Vec<FileKey> {
    let cmd = gateway_command();
    cmd.get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            if arg.get_id() == CONFIG_ARG {
                return None;
            }
            let kind = match arg.get_action() {
                ArgAction::SetTrue | ArgAction::SetFalse => KeyKind::Flag,
                ArgAction::Append => KeyKind::List,
                _ => KeyKind::One,
            };
            Some(FileKey {
                key: long.replace('-', "_"),
                long: long.to_owned(),
                id: arg.get_id().to_string(),
                env: arg.get_env().map(|e| e.to_string_lossy().into_owned()),
                kind,
                value_name: arg
                    .get_value_names()
                    .and_then(|v| v.first())
                    .map(ToString::to_string),
                help: arg
                    .get_long_help()
                    .or_else(|| arg.get_help())
                    .map(|h| h.to_string())
                    .unwrap_or_default(),
                default: arg
                    .get_default_values()
                    .iter()
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect(),
            })
        })
        .collect()
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// The built-in default: the flag's, or, for a route key with no
    /// top-level setting (`guard`, `key_header`, `fingerprint_*`,
    /// `statuses` …), the route key's own ([`ROUTE_KEYS`]).
    Default,
    /// The file, at this line.
    File(usize),
    /// This environment variable.
    Env(String),
    /// The command line.
    Flag,
    /// A route's own key, at this line.
    Route(usize),
    /// A route's value taken from the top-level setting of that name
    /// (`ttl`, `lease`, `methods`; `scope_headers` from `scope_header`).
    Inherited,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Default => f.write_str("default"),
            Self::File(line) => write!(f, "file:{line}"),
            Self::Env(var) => write!(f, "env {var}"),
            Self::Flag => f.write_str("flag"),
            Self::Route(line) => write!(f, "route:{line}"),
            Self::Inherited => f.write_str("inherited"),
        }
    }
}

/// One effective value and its source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    /// The file key (`ttl`, `scope_header`, a route's `key_json_pointer`).
    pub key: String,
    /// The value as the file would write it (`24h`, `x-api-key,x-tenant`);
    /// a store URL with its password as `***`.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

/// The effective settings of one route, for `idem config check`.
#[derive(Debug, Clone)]
pub struct RouteReport {
    /// The route's name (`default` for the implicit last route).
    pub name: String,
    /// The line of its `[[routes]]` header; `None` for `default`.
    pub line: Option<usize>,
    /// Every effective value, in [`ROUTE_KEYS`] order.
    pub settings: Vec<Setting>,
}

/// What [`load`] found: the effective top-level settings and the routes in
/// match order, the implicit `default` route last.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Every top-level key in [`file_keys`] order.
    pub settings: Vec<Setting>,
    /// The routes in match order, then `default`.
    pub routes: Vec<RouteReport>,
}

impl Report {
    /// The effective value of a top-level key.
    pub fn value(&self, key: &str) -> Option<&str> {
        self.settings
            .iter()
            .find(|s| s.key == key)
            .map(|s| s.value.as_str())
    }
}

/// `key = value  # source` lines, the values in one column.
fn write_settings(f: &mut fmt::Formatter<'_>, settings: &[Setting]) -> fmt::Result {
    let width = settings.iter().map(|s| s.key.len()).max().unwrap_or(0);
    for s in settings {
        writeln!(
            f,
            "{:<width$} = {:<40} # {}",
            s.key,
            quote(&s.value),
            s.source
        )?;
    }
    Ok(())
}

impl fmt::Display for Report {
    /// The listing `idem config check` prints: `key = value  # source`
    /// lines, then each route as a `[[routes]]` block.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_settings(f, &self.settings)?;
        writeln!(f)?;
        let tables = self.routes.iter().filter(|r| r.line.is_some()).count();
        writeln!(
            f,
            "# routes in match order (first match wins): {tables} {} + default:",
            if tables == 1 { "route" } else { "routes" }
        )?;
        for r in &self.routes {
            writeln!(f)?;
            match r.line {
                Some(line) => writeln!(f, "[[routes]]  # {}, line {line}", r.name)?,
                None => writeln!(
                    f,
                    "# [[routes]]  # {}: implicit, requests no route matches",
                    r.name
                )?,
            }
            write_settings(f, &r.settings)?;
        }
        Ok(())
    }
}

/// A value as TOML would write it: booleans and numbers bare, the rest quoted.
fn quote(v: &str) -> String {
    if v == "true" || v == "false" || (!v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())) {
        v.to_owned()
    } else {
        format!("{v:?}")
    }
}

/// The largest configuration file read: 1 MiB (1 048 576 bytes). A
/// larger one is refused at start ([`LoadError::TooLarge`], exit status 2)
/// and on reload (the running configuration stays), before it is parsed.
/// Thousands of routes fit in a fraction of it.
pub const MAX_CONFIG_FILE: u64 = 1 << 20;

/// Why a configuration file could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file cannot be read (missing, no permission, a directory, not
    /// UTF-8).
    #[error("{}: cannot read the configuration file: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is larger than [`MAX_CONFIG_FILE`].
    #[error(
        "{}: the configuration file is larger than {} bytes (1 MiB), the most idem reads",
        path.display(),
        MAX_CONFIG_FILE
    )]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// On reload: the file holds no key, only whitespace and comments (a
    /// file truncated, or caught half-written); [`load_for_reload`].
    #[error(
        "{}: the configuration file is empty (only whitespace or comments); a reload does not \
         apply it. Write the file whole: a temporary file renamed over it",
        path.display()
    )]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A problem at a place in the file: TOML syntax, an unknown key, a
    /// value of the wrong type or one its parser refuses, a bad route.
    #[error("{}:{line}:{column}: {message}", path.display())]
    At {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column (in characters).
        column: usize,
        /// What is wrong.
        message: String,
    },
    /// The flags (or IDEM_* variables) are refused by clap.
    #[error("{0}")]
    Args(String),
    /// The layered settings do not work together.
    #[error("{0}")]
    Config(#[from] ConfigError),
}

/// An error and its sources, joined with ": " (a source its error already
/// shows is not repeated).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// 1-based line and column of byte `offset` in `text`.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..text.floor_char_boundary_compat(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

trait FloorBoundary {
    fn floor_char_boundary_compat(&self, i: usize) -> usize;
}

impl FloorBoundary for str {
    fn floor_char_boundary_compat(&self, mut i: usize) -> usize {
        while i > 0 && !self.is_char_boundary(i) {
            i -= 1;
        }
        i
    }
}

/// Where the running configuration came from: the file, the command line
/// it was layered under, and what it gave at start. Its `Debug` shows the
/// path only (the command line may hold a store password).
#[derive(Clone)]
pub struct ConfigSource {
    /// The configuration file.
    pub path: PathBuf,
    /// The command line as clap parsed it (the arguments of `idem gateway`).
    pub matches: ArgMatches,
    /// The effective settings at start.
    pub report: Report,
}

impl std::fmt::Debug for ConfigSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigSource")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// What [`load`] made.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The flags as layered (command line, IDEM_* variables, file).
    pub args: GatewayArgs,
    /// The validated configuration, routes included; its
    /// [`GatewayConfig::config_source`] names the file.
    pub config: GatewayConfig,
    /// Every effective value with its source.
    pub report: Report,
    /// The file's [`LOG_FORMAT_KEY`] (`text` or `json`), if it has one.
    pub log_format: Option<String>,
}

/// Reads `path` and layers it under the command line `matches` (parsed by
/// a command that flattens [`GatewayArgs`]: `idem gateway`, `idem config
/// check`) and the IDEM_* variables, then builds and validates the
/// configuration with its routes.
///
/// # Errors
/// [`LoadError::Read`], [`LoadError::At`] (with the line) for the file's
/// own problems, [`LoadError::Args`] when clap refuses the layered flags,
/// [`LoadError::Config`] when the settings do not work together (a bad
/// route's error names it, at its line as [`LoadError::At`]).
pub fn load(matches: &ArgMatches, path: &Path) -> Result<Loaded, LoadError> {
    let text = read(path)?;
    load_str(matches, path, &text)
}

/// [`load`] as a reload does it: a file with no key (empty, or only
/// whitespace and comments: truncated, or caught half-written) is refused
/// with [`LoadError::Empty`] rather than applied as "every default, no
/// route". Blocking file I/O: call it off the async workers
/// (`tokio::task::spawn_blocking`).
///
/// # Errors
/// As [`load`], and [`LoadError::Empty`].
pub fn load_for_reload(matches: &ArgMatches, path: &Path) -> Result<Loaded, LoadError> {
    let text = read(path)?;
    if is_blank(&text) {
        return Err(LoadError::Empty {
            path: path.to_owned(),
        });
    }
    load_str(matches, path, &text)
}

/// Whether a TOML text holds nothing but whitespace and comments (lines
/// whose first non-blank character is `#`).
pub fn is_blank(text: &str) -> bool {
    text.lines().all(|l| {
        let t = l.trim();
        t.is_empty() || t.starts_with('#')
    })
}

/// The file's text, read with a bound: at most [`MAX_CONFIG_FILE`] bytes
/// (a larger file is refused without reading the rest), UTF-8.
///
/// # Errors
/// [`LoadError::Read`] (cannot open or read it, not UTF-8),
/// [`LoadError::TooLarge`].
pub fn read(path: &Path) -> Result<String, LoadError> {
    use std::io::Read as _;
    let failed = |source| LoadError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(failed)?;
    if file.metadata().map_err(failed)?.len() > MAX_CONFIG_FILE {
        return Err(LoadError::TooLarge {
            path: path.to_owned(),
        });
    }
    let mut bytes = Vec::new();
    // One byte more than the limit: a file that grew since is seen.
    file.take(MAX_CONFIG_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(failed)?;
    if bytes.len() as u64 > MAX_CONFIG_FILE {
        return Err(LoadError::TooLarge {
            path: path.to_owned(),
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        failed(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 (TOML files are UTF-8): {e}"),
        ))
    })
}

/// [`load`] for a file's text already read (`path` names it in errors).
///
/// # Errors
/// As [`load`], without [`LoadError::Read`].
pub fn load_str(matches: &ArgMatches, path: &Path, text: &str) -> Result<Loaded, LoadError> {
    let at = |span: std::ops::Range<usize>, message: String| {
        let (line, column) = line_col(text, span.start);
        LoadError::At {
            path: path.to_owned(),
            line,
            column,
            message,
        }
    };
    let doc = DeTable::parse(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        at(span, format!("not valid TOML: {}", e.message()))
    })?;
    let doc = doc.into_inner();
    let keys = file_keys();
    let cmd = gateway_command();
    // Top level: each key checked by its flag's parser.
    let mut file_values: BTreeMap<String, (Vec<String>, usize)> = BTreeMap::new();
    let mut routes_value = None;
    let mut log_format = None;
    for (k, v) in &doc {
        let name: &str = k.get_ref();
        if name == "routes" {
            routes_value = Some(v);
            continue;
        }
        if name == LOG_FORMAT_KEY {
            match v.get_ref() {
                DeValue::String(f) if f == "text" || f == "json" => {
                    log_format = Some(f.to_string());
                }
                _ => return Err(at(v.span(), format!("`{name}`: \"text\" or \"json\""))),
            }
            continue;
        }
        let Some(fk) = keys.iter().find(|fk| fk.key == name) else {
            let hint = if name == CONFIG_ARG {
                "`config` cannot be set in the configuration file itself".to_owned()
            } else if let Some(fk) = keys.iter().find(|fk| fk.long == name) {
                format!("unknown key `{name}`; write it `{}`", fk.key)
            } else {
                format!(
                    "unknown key `{name}`; the top-level keys are the `idem gateway` flags \
                     with '-' written '_' (see `idem config schema`) and [[routes]]"
                )
            };
            return Err(at(k.span(), hint));
        };
        let values = flag_values(fk, v).map_err(|m| at(v.span(), format!("`{name}`: {m}")))?;
        if fk.kind == KeyKind::List && values.is_empty() && !fk.default.is_empty() {
            // An empty array would leave the flag unset, so its default
            // would apply: `scope_header = []` would scope by
            // authorization. Refused, as a route's empty list is.
            let what = match fk.key.as_str() {
                "scope_header" => "names no header",
                "methods" => "names no method",
                _ => "is empty",
            };
            return Err(at(
                v.span(),
                format!(
                    "`{name}`: {what} (an empty array would mean the default, {}); leave the key out for the default",
                    fk.default.join(",")
                ),
            ));
        }
        if fk.kind != KeyKind::Flag {
            // The flag's own parser, on a command of that flag alone
            // (without its variable, so only the file's value is judged).
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id() == fk.id.as_str())
                .expect("the key was read from this command")
                .clone()
                .env(clap::builder::Resettable::Reset)
                .required(false)
                // Relations name other flags, absent from the probe (they
                // are checked on the whole command once layered).
                .requires(clap::builder::Resettable::Reset)
                .conflicts_with(clap::builder::Resettable::Reset);
            let mut probe = vec![OsString::from("probe")];
            probe.extend(
                values
                    .iter()
                    .map(|v| OsString::from(format!("--{}={v}", fk.long))),
            );
            Command::new("probe")
                .arg(arg)
                .try_get_matches_from(probe)
                .map_err(|e| at(v.span(), format!("`{name}`: {}", clap_message(&e))))?;
        }
        let (line, _) = line_col(text, k.span().start);
        file_values.insert(fk.key.clone(), (values, line));
    }
    // Layering: the command line as given, the variables (clap reads them
    // again), the file where neither set the flag.
    let mut argv: Vec<OsString> = vec!["idem-gateway".into()];
    let mut sources = BTreeMap::new();
    for fk in &keys {
        let source = matches.value_source(&fk.id);
        let src = match source {
            Some(ValueSource::CommandLine) => {
                push_raw(&mut argv, fk, matches);
                Source::Flag
            }
            Some(ValueSource::EnvVariable) => Source::Env(fk.env.clone().unwrap_or_default()),
            _ => match file_values.get(&fk.key) {
                Some((values, line)) => {
                    for v in values {
                        match fk.kind {
                            KeyKind::Flag => {
                                if v == "true" {
                                    argv.push(format!("--{}", fk.long).into());
                                }
                            }
                            _ => argv.push(format!("--{}={v}", fk.long).into()),
                        }
                    }
                    Source::File(*line)
                }
                None => Source::Default,
            },
        };
        sources.insert(fk.key.clone(), src);
    }
    if matches.value_source(CONFIG_ARG) == Some(ValueSource::CommandLine) {
        if let Some(raw) = matches.get_raw(CONFIG_ARG) {
            for r in raw {
                let mut a = OsString::from("--config=");
                a.push(r);
                argv.push(a);
            }
        }
    }
    let final_matches = gateway_command()
        .try_get_matches_from(argv)
        .map_err(|e| LoadError::Args(clap_message(&e)))?;
    let args = GatewayArgs::from_arg_matches(&final_matches)
        .map_err(|e| LoadError::Args(clap_message(&e)))?;
    let mut config = args
        .clone()
        .into_config()
        .map_err(|e| at_key_line(path, e, &sources, &keys))?;
    let mut settings = Vec::new();
    for fk in &keys {
        let value = match fk.kind {
            KeyKind::Flag => final_matches.get_flag(&fk.id).to_string(),
            _ => final_matches
                .get_raw(&fk.id)
                .map(|raw| {
                    raw.map(|r| r.to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default(),
        };
        let value = if fk.key == "store" {
            RedactedUrl::new(value).redacted()
        } else {
            value
        };
        settings.push(Setting {
            key: fk.key.clone(),
            value,
            source: sources.remove(&fk.key).unwrap_or(Source::Default),
        });
    }
    // Routes.
    let mut routes = Vec::new();
    let mut route_reports = Vec::new();
    let mut lines = Vec::new();
    if let Some(v) = routes_value {
        let DeValue::Array(items) = v.get_ref() else {
            return Err(at(
                v.span(),
                "`routes` must be an array of tables: write each route as [[routes]]".into(),
            ));
        };
        for (i, item) in items.iter().enumerate() {
            let DeValue::Table(table) = item.get_ref() else {
                return Err(at(item.span(), format!("routes[{i}] is not a table")));
            };
            let first_key = table
                .iter()
                .map(|(k, _)| k.span().start)
                .min()
                .unwrap_or(item.span().start);
            let (line, _) = line_col(text, header_start(text, first_key));
            let (route, report) = build_route(&config.layer, table, i, line, text)
                .map_err(|(span, m)| at(span.unwrap_or_else(|| item.span()), m))?;
            lines.push((route.name.clone(), line));
            routes.push(route);
            route_reports.push(report);
        }
    }
    route_reports.push(default_report(&config.layer));
    config.routes = routes;
    config.validate().map_err(|e| match &e {
        ConfigError::Route(RouteError::Invalid { route, .. })
        | ConfigError::Route(RouteError::DuplicateName(route))
        | ConfigError::Route(RouteError::Name(route)) => {
            match lines.iter().rev().find(|(n, _)| n == route) {
                Some((_, line)) => LoadError::At {
                    path: path.to_owned(),
                    line: *line,
                    column: 1,
                    message: e.to_string(),
                },
                None => LoadError::Config(e),
            }
        }
        _ => LoadError::Config(e),
    })?;
    let report = Report {
        settings,
        routes: route_reports,
    };
    config.config_source = Some(ConfigSource {
        path: path.to_owned(),
        matches: matches.clone(),
        report: report.clone(),
    });
    Ok(Loaded {
        args,
        config,
        report,
        log_format,
    })
}

/// A refused combination, at the line of the first flag its message names
/// when that flag's value came from the file (`idem.toml:3:1: `lease`:
/// --lease (500ms) must be at least 1s …`); else as it is.
fn at_key_line(
    path: &Path,
    e: ConfigError,
    sources: &BTreeMap<String, Source>,
    keys: &[FileKey],
) -> LoadError {
    let text = error_chain(&e);
    let named = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter_map(|w| w.strip_prefix("--"))
        .find_map(|long| keys.iter().find(|k| k.long == long));
    if let Some(fk) = named {
        if let Some(Source::File(line)) = sources.get(&fk.key) {
            return LoadError::At {
                path: path.to_owned(),
                line: *line,
                column: 1,
                message: format!("`{}`: {text}", fk.key),
            };
        }
    }
    LoadError::Config(e)
}

/// The start of the `[[routes]]` line a table's span begins in (the span
/// of an array-of-tables entry starts at its header, or at its first key).
fn header_start(text: &str, start: usize) -> usize {
    let before = &text[..start.min(text.len())];
    match before.rfind("[[") {
        Some(i)
            if before[i..]
                .trim_start_matches("[[")
                .trim_start()
                .starts_with("routes") =>
        {
            i
        }
        _ => start,
    }
}

/// The raw values given on the command line, as `--long=value` again.
fn push_raw(argv: &mut Vec<OsString>, fk: &FileKey, matches: &ArgMatches) {
    if fk.kind == KeyKind::Flag {
        if matches.get_flag(&fk.id) {
            argv.push(format!("--{}", fk.long).into());
        }
        return;
    }
    if let Some(raw) = matches.get_raw(&fk.id) {
        for r in raw {
            let mut a = OsString::from(format!("--{}=", fk.long));
            a.push(r);
            argv.push(a);
        }
    }
}

/// clap's message without its `error: ` prefix and usage lines.
fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
    let first = lines.next().unwrap_or("").trim();
    let mut message = first.strip_prefix("error: ").unwrap_or(first).to_owned();
    // "the following required arguments were not provided:" lists them on
    // the indented lines after it.
    if message.ends_with(':') {
        let listed: Vec<&str> = lines
            .take_while(|l| l.starts_with(' '))
            .map(str::trim)
            .collect();
        message.push(' ');
        message.push_str(&listed.join(", "));
    }
    message
}

/// The strings a top-level value stands for.
fn flag_values(fk: &FileKey, v: &Spanned<DeValue<'_>>) -> Result<Vec<String>, String> {
    match (fk.kind, v.get_ref()) {
        (KeyKind::Flag, DeValue::Boolean(b)) => Ok(vec![b.to_string()]),
        (KeyKind::Flag, other) => Err(format!("expected a boolean, found {}", other.type_str())),
        (KeyKind::List, DeValue::Array(items)) => items
            .iter()
            .map(|i| scalar(i.get_ref()))
            .collect::<Result<_, _>>(),
        (KeyKind::List, other) => Ok(vec![scalar(other)
            .map_err(|_| format!("expected an array of strings, found {}", other.type_str()))?]),
        (KeyKind::One, other) => Ok(vec![scalar(other)?]),
    }
}

/// A string, or an integer's decimal digits.
fn scalar(v: &DeValue<'_>) -> Result<String, String> {
    match v {
        DeValue::String(s) => Ok(s.to_string()),
        DeValue::Integer(i) if i.radix() == 10 => Ok(i.as_str().replace('_', "")),
        other => Err(format!(
            "expected a string (or an integer), found {}",
            other.type_str()
        )),
    }
}

/// The type of a route key's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RouteKeyType {
    /// A string.
    String,
    /// A boolean.
    Bool,
    /// A duration string (`"24h"`, `"60s"`, `"500ms"`).
    Duration,
    /// A byte size: an integer, or a string with a unit (`"1MiB"`).
    Size,
    /// An array of strings.
    Strings,
    /// One of these strings.
    Enum(&'static [&'static str]),
    /// A table of status patterns (`"504"`, `"5xx"`) to `store`,
    /// `release` or `hold`.
    Statuses,
}

/// One key of a `[[routes]]` table.
#[derive(Debug, Clone, Copy)]
pub struct RouteKey {
    /// The key.
    pub key: &'static str,
    /// Its type.
    pub ty: RouteKeyType,
    /// Its default, in words.
    pub default: &'static str,
    /// What it means.
    pub doc: &'static str,
}

/// Every key of a `[[routes]]` table, in the order `idem config check`
/// shows them.
pub const ROUTE_KEYS: &[RouteKey] = &[
    RouteKey { key: "name", ty: RouteKeyType::String, default: "required", doc: "The route's name in logs and in the `route` label of the request metrics: 1 to 64 characters of A-Z a-z 0-9 _ . -, unique, not `default`." },
    RouteKey { key: "path", ty: RouteKeyType::String, default: "required", doc: "The paths covered: a prefix by segment (`/payments` covers `/payments/42`, not `/paymentsx` or `/payments.json`); `{name}` matches one segment; `*`, `?`, `#` and spaces are refused. Matched on the normalised, percent-decoded, lower-cased path." },
    RouteKey { key: "methods", ty: RouteKeyType::Strings, default: "the top-level `methods`", doc: "The methods the route covers (and guards), case-insensitive; a request with another method falls to the next route or the default. Not empty; safe methods and CONNECT are refused." },
    RouteKey { key: "guard", ty: RouteKeyType::Bool, default: "true", doc: "false: the route's requests are passed through untouched (no key, no store); a top-level `require_token` prefix still holds." },
    RouteKey { key: "require_key", ty: RouteKeyType::Bool, default: "the top-level `require_key`", doc: "Answer 400 `key-required` to a request without a key." },
    RouteKey { key: "require_token", ty: RouteKeyType::Bool, default: "false", doc: "The keys must be live submit tokens from `POST /_idem/tokens` (428 without, 403 unknown); the route's ttl must be at least `token_ttl`." },
    RouteKey { key: "ttl", ty: RouteKeyType::Duration, default: "the top-level `ttl`", doc: "How long a completed result is replayed; at least the lease." },
    RouteKey { key: "lease", ty: RouteKeyType::Duration, default: "the top-level `lease`", doc: "How long a claim holds (renewed while the upstream runs): at least 1s and longer than `store_timeout`." },
    RouteKey { key: "wait", ty: RouteKeyType::Duration, default: "the top-level `wait`", doc: "How long a duplicate waits for the original in flight; 0 answers 409 at once." },
    RouteKey { key: "share_failure", ty: RouteKeyType::Duration, default: "the top-level `share_failure`", doc: "How long a released failure (5xx, upstream unreachable) is kept for the duplicates that waited for it; a later retry waits out the window and runs again; 0 releases at once." },
    RouteKey { key: "hold_for", ty: RouteKeyType::Duration, default: "the top-level `hold_for`", doc: "How long a key whose outcome is unknown (504, broken body, result not saved) stays held before a retry may run it again; 0 holds it until its lease ends." },
    RouteKey { key: "max_body", ty: RouteKeyType::Size, default: "the top-level `max_body`", doc: "Largest request body, bytes (413 beyond); above 0, at most `max_buffered`." },
    RouteKey { key: "retention_limit", ty: RouteKeyType::Size, default: "the top-level `retention_limit`", doc: "Largest response body kept for replay, bytes." },
    RouteKey { key: "scope_headers", ty: RouteKeyType::Strings, default: "the top-level `scope_header`", doc: "Request headers that identify the caller (keys are scoped by them); not empty; checked as `--scope-header`." },
    RouteKey { key: "key_header", ty: RouteKeyType::String, default: "Idempotency-Key", doc: "The header the key is read from (no other header is). Not with `key_json_pointer`." },
    RouteKey { key: "key_json_pointer", ty: RouteKeyType::String, default: "none (the key header)", doc: "A JSON Pointer (RFC 6901) into the body (any body that is I-JSON, RFC 7493) whose string or integer is the key, e.g. `/event_id`; `\"777\"` and `777` are the same key; a member that is not a key, or a body that is not I-JSON, gets 400. Not with `key_header`." },
    RouteKey { key: "fingerprint_method", ty: RouteKeyType::Bool, default: "true", doc: "The method counts in the request fingerprint." },
    RouteKey { key: "fingerprint_path", ty: RouteKeyType::Bool, default: "true", doc: "The normalised path counts (without it the route's name does)." },
    RouteKey { key: "fingerprint_query", ty: RouteKeyType::Bool, default: "true", doc: "The query counts." },
    RouteKey { key: "fingerprint_ignore_query", ty: RouteKeyType::Strings, default: "[]", doc: "Query parameters left out of the fingerprint, by name (the query split at `&` and `;`)." },
    RouteKey { key: "fingerprint_headers", ty: RouteKeyType::Strings, default: "[]", doc: "Request headers that count besides Content-Type." },
    RouteKey { key: "fingerprint_body", ty: RouteKeyType::Bool, default: "true", doc: "The body counts." },
    RouteKey { key: "fingerprint_exclude", ty: RouteKeyType::Strings, default: "[]", doc: "JSON Pointers (RFC 6901) of body members left out of the fingerprint (e.g. `/delivered_at`); JSON bodies only (Content-Type application/json or */*+json)." },
    RouteKey { key: "fingerprint_include", ty: RouteKeyType::Strings, default: "[] (the whole body)", doc: "When set, only these JSON Pointers of the body count; JSON bodies only (Content-Type application/json or */*+json)." },
    RouteKey { key: "status_policy", ty: RouteKeyType::Enum(&["default", "store-5xx"]), default: "default", doc: "Which statuses are stored: `default` (2xx-4xx stored except 408/409/425/429; 5xx released) or `store-5xx` (Stripe's: 5xx stored and replayed, 502/503 released, 504 held)." },
    RouteKey { key: "statuses", ty: RouteKeyType::Statuses, default: "{}", doc: "Overrides on top of `status_policy`: a status (`\"504\"`) or a class (`\"5xx\"`) to `store`, `release` or `hold`; the exact status wins over its class; a 2xx cannot be released or held." },
];

type RouteErr = (Option<std::ops::Range<usize>>, String);

/// A route from its table, starting from the top-level `layer`.
fn build_route(
    layer: &Options,
    table: &DeTable<'_>,
    index: usize,
    header_line: usize,
    text: &str,
) -> Result<(Route, RouteReport), RouteErr> {
    let find = |key: &str| table.iter().find(|(k, _)| k.get_ref() == key);
    for (k, _) in table {
        if !ROUTE_KEYS.iter().any(|rk| rk.key == k.get_ref()) {
            let known: Vec<&str> = ROUTE_KEYS.iter().map(|rk| rk.key).collect();
            return Err((
                Some(k.span()),
                format!(
                    "routes[{index}]: unknown route key `{}`; the route keys are {}",
                    k.get_ref(),
                    known.join(", ")
                ),
            ));
        }
    }
    let name = match find("name") {
        Some((_, v)) => match v.get_ref() {
            DeValue::String(s) => s.to_string(),
            other => {
                return Err((
                    Some(v.span()),
                    format!(
                        "routes[{index}]: `name`: expected a string, found {}",
                        other.type_str()
                    ),
                ))
            }
        },
        None => return Err((None, format!("routes[{index}]: `name` is required"))),
    };
    let ctx = format!("route {name:?}");
    let err = |v: &Spanned<DeValue<'_>>, key: &str, m: String| -> RouteErr {
        (Some(v.span()), format!("{ctx}: `{key}`: {m}"))
    };
    let string = |v: &Spanned<DeValue<'_>>, key: &str| -> Result<String, RouteErr> {
        match v.get_ref() {
            DeValue::String(s) => Ok(s.to_string()),
            other => Err(err(
                v,
                key,
                format!("expected a string, found {}", other.type_str()),
            )),
        }
    };
    let boolean = |v: &Spanned<DeValue<'_>>, key: &str| -> Result<bool, RouteErr> {
        match v.get_ref() {
            DeValue::Boolean(b) => Ok(*b),
            other => Err(err(
                v,
                key,
                format!("expected a boolean, found {}", other.type_str()),
            )),
        }
    };
    let strings = |v: &Spanned<DeValue<'_>>, key: &str| -> Result<Vec<String>, RouteErr> {
        match v.get_ref() {
            DeValue::Array(items) => items
                .iter()
                .map(|i| match i.get_ref() {
                    DeValue::String(s) => Ok(s.to_string()),
                    other => Err(err(
                        i,
                        key,
                        format!(
                            "expected an array of strings, found {} in it",
                            other.type_str()
                        ),
                    )),
                })
                .collect(),
            other => Err(err(
                v,
                key,
                format!("expected an array of strings, found {}", other.type_str()),
            )),
        }
    };
    let duration = |v: &Spanned<DeValue<'_>>, key: &str| -> Result<std::time::Duration, RouteErr> {
        parse_duration(&string(v, key)?).map_err(|m| err(v, key, m))
    };
    let size = |v: &Spanned<DeValue<'_>>, key: &str| -> Result<usize, RouteErr> {
        match v.get_ref() {
            DeValue::String(s) => parse_size(s).map_err(|m| err(v, key, m)),
            DeValue::Integer(i) if i.radix() == 10 => {
                parse_size(&i.as_str().replace('_', "")).map_err(|m| err(v, key, m))
            }
            other => Err(err(
                v,
                key,
                format!(
                    "expected a size (an integer or a string such as \"1MiB\"), found {}",
                    other.type_str()
                ),
            )),
        }
    };
    let pointer = |v: &Spanned<DeValue<'_>>, key: &str, p: String| -> Result<String, RouteErr> {
        if p.is_empty() || p.starts_with('/') {
            Ok(p)
        } else {
            Err(err(
                v,
                key,
                format!("{p:?} is not a JSON Pointer (RFC 6901: empty or starting with '/')"),
            ))
        }
    };

    let Some((_, path_v)) = find("path") else {
        return Err((None, format!("{ctx}: `path` is required")));
    };
    let path_raw = string(path_v, "path")?;
    let mut route = Route::new(name.clone(), &path_raw, layer.clone())
        .map_err(|e| err(path_v, "path", e.to_string()))?;
    let mut o = layer.clone();
    o.fingerprint = FingerprintSpec {
        route: name.clone(),
        ..layer.fingerprint.clone()
    };
    let mut fp = o.fingerprint.clone();
    let mut base_policy = None;
    let mut overrides: Vec<(String, Disposition)> = Vec::new();
    let mut key_set: Option<&str> = None;
    for (k, v) in table {
        let key: &str = k.get_ref();
        match key {
            "name" | "path" => {}
            "methods" => {
                let list = strings(v, key)?;
                if list.is_empty() {
                    return Err(err(v, key, "names no method".into()));
                }
                let mut methods = Vec::new();
                for m in list {
                    let m = parse_method(&m).map_err(|e| err(v, key, e))?;
                    if !methods.contains(&m) {
                        methods.push(m);
                    }
                }
                o.methods = methods;
            }
            "guard" => route.guard = boolean(v, key)?,
            "require_key" => o.require_key = boolean(v, key)?,
            "require_token" => route.require_token = boolean(v, key)?,
            "ttl" => o.ttl = duration(v, key)?,
            "lease" => o.lease = duration(v, key)?,
            "wait" => o.wait = duration(v, key)?,
            "share_failure" => o.share_failure = duration(v, key)?,
            "hold_for" => o.hold_for = duration(v, key)?,
            "max_body" => o.max_body = size(v, key)?,
            "retention_limit" => o.retention_limit = size(v, key)?,
            "scope_headers" => {
                let mut names: Vec<HeaderName> = Vec::new();
                for raw in strings(v, key)? {
                    let n = parse_scope_header(&raw).map_err(|e| err(v, key, e))?;
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
                if names.is_empty() {
                    return Err(err(v, key, "names no header".into()));
                }
                o.scope = ScopeBy::Headers(names);
            }
            "key_header" | "key_json_pointer" => {
                if let Some(other) = key_set {
                    return Err(err(
                        v,
                        key,
                        format!("`key_header` and `key_json_pointer` exclude each other (`{other}` is set too)"),
                    ));
                }
                key_set = Some(if key == "key_header" {
                    "key_header"
                } else {
                    "key_json_pointer"
                });
                let raw = string(v, key)?;
                o.key_source =
                    if key == "key_header" {
                        KeySource::Header(HeaderName::from_bytes(raw.trim().as_bytes()).map_err(
                            |_| err(v, key, format!("{raw:?} is not a valid header name")),
                        )?)
                    } else {
                        KeySource::JsonPointer(pointer(v, key, raw)?)
                    };
            }
            "fingerprint_method" => fp.method = boolean(v, key)?,
            "fingerprint_path" => fp.path = boolean(v, key)?,
            "fingerprint_query" => fp.query = boolean(v, key)?,
            "fingerprint_body" => fp.body = boolean(v, key)?,
            "fingerprint_ignore_query" => fp.ignore_query = strings(v, key)?,
            "fingerprint_headers" => {
                fp.headers = strings(v, key)?
                    .into_iter()
                    .map(|h| {
                        HeaderName::from_bytes(h.trim().as_bytes())
                            .map_err(|_| err(v, key, format!("{h:?} is not a valid header name")))
                    })
                    .collect::<Result<_, _>>()?;
            }
            "fingerprint_exclude" | "fingerprint_include" => {
                let list = strings(v, key)?
                    .into_iter()
                    .map(|p| pointer(v, key, p))
                    .collect::<Result<Vec<_>, _>>()?;
                if key == "fingerprint_exclude" {
                    fp.exclude = list;
                } else {
                    fp.include = list;
                }
            }
            "status_policy" => {
                base_policy = Some(match string(v, key)?.as_str() {
                    "default" => StatusPolicy::default(),
                    "store-5xx" => StatusPolicy::store_5xx(),
                    other => {
                        return Err(err(
                            v,
                            key,
                            format!("{other:?} is neither \"default\" nor \"store-5xx\""),
                        ))
                    }
                });
            }
            "statuses" => {
                let DeValue::Table(t) = v.get_ref() else {
                    return Err(err(
                        v,
                        key,
                        format!(
                            "expected a table such as {{ \"504\" = \"hold\" }}, found {}",
                            v.get_ref().type_str()
                        ),
                    ));
                };
                for (pk, pv) in t {
                    let d = match string(pv, key)?.as_str() {
                        "store" => Disposition::Store,
                        "release" => Disposition::Release,
                        "hold" => Disposition::Hold,
                        other => {
                            return Err(err(
                                pv,
                                key,
                                format!("{other:?} is not store, release or hold"),
                            ))
                        }
                    };
                    overrides.push((pk.get_ref().to_string(), d));
                    // Checked now, so the error points at the pattern.
                    StatusPolicy::default()
                        .with(pk.get_ref(), d)
                        .map_err(|e| (Some(pk.span()), format!("{ctx}: `statuses`: {e}")))?;
                }
            }
            _ => unreachable!("unknown keys are refused above"),
        }
    }
    let mut policy = base_policy.unwrap_or_else(|| layer.policy.clone());
    for (pattern, d) in overrides {
        policy = policy
            .with(&pattern, d)
            .map_err(|e| (None, format!("{ctx}: `statuses`: {e}")))?;
    }
    o.policy = policy;
    o.fingerprint = fp;
    route.options = o;
    let given: BTreeMap<String, usize> = table
        .iter()
        .map(|(k, _)| (k.get_ref().to_string(), line_col(text, k.span().start).0))
        .collect();
    let mut settings = route_settings(&route, &given);
    if let Some((_, v)) = find("status_policy") {
        if let Some(s) = settings.iter_mut().find(|s| s.key == "status_policy") {
            s.value = string(v, "status_policy")?;
        }
    }
    let report = RouteReport {
        name: name.clone(),
        line: Some(header_line),
        settings,
    };
    Ok((route, report))
}

/// The implicit last route: the top-level settings.
fn default_report(layer: &Options) -> RouteReport {
    let route = Route {
        name: idem_http::routes::DEFAULT_ROUTE.to_owned(),
        path: "/".parse().expect("`/` is a pattern"),
        guard: true,
        require_token: false,
        options: layer.clone(),
    };
    let settings = route_settings(&route, &BTreeMap::new());
    RouteReport {
        name: route.name,
        line: None,
        settings,
    }
}

/// The route keys whose default is a top-level setting (`scope_headers`
/// takes `scope_header`): a route that does not set them shows them
/// `inherited`; the other keys it does not set show `default`.
const INHERITED: &[&str] = &[
    "methods",
    "require_key",
    "ttl",
    "lease",
    "wait",
    "share_failure",
    "hold_for",
    "max_body",
    "retention_limit",
    "scope_headers",
];

/// Every effective value of a route; `given` maps the keys its table set
/// to their lines (sources `route:LINE`).
fn route_settings(route: &Route, given: &BTreeMap<String, usize>) -> Vec<Setting> {
    let o = &route.options;
    let fp = &o.fingerprint;
    let list = |v: &[String]| v.join(",");
    let (key_header, key_pointer) = match &o.key_source {
        KeySource::Header(h) => (h.to_string(), String::new()),
        KeySource::JsonPointer(p) => (String::new(), p.clone()),
    };
    let policy = {
        let over = o.policy.overrides();
        if over.is_empty() {
            String::new()
        } else {
            over.iter()
                .map(|(p, d)| format!("{p}={}", disposition_name(*d)))
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    let values: Vec<(&str, String)> = vec![
        ("name", route.name.clone()),
        ("path", route.path.to_string()),
        (
            "methods",
            o.methods
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("guard", route.guard.to_string()),
        ("require_key", o.require_key.to_string()),
        ("require_token", route.require_token.to_string()),
        ("ttl", show_duration(o.ttl)),
        ("lease", show_duration(o.lease)),
        ("wait", show_duration(o.wait)),
        ("share_failure", show_duration(o.share_failure)),
        ("hold_for", show_duration(o.hold_for)),
        ("max_body", show_size(o.max_body)),
        ("retention_limit", show_size(o.retention_limit)),
        ("scope_headers", show_scope(&o.scope)),
        ("key_header", key_header),
        ("key_json_pointer", key_pointer),
        ("fingerprint_method", fp.method.to_string()),
        ("fingerprint_path", fp.path.to_string()),
        ("fingerprint_query", fp.query.to_string()),
        ("fingerprint_ignore_query", list(&fp.ignore_query)),
        (
            "fingerprint_headers",
            fp.headers
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("fingerprint_body", fp.body.to_string()),
        ("fingerprint_exclude", list(&fp.exclude)),
        ("fingerprint_include", list(&fp.include)),
        ("status_policy", String::new()),
        ("statuses", policy),
    ];
    values
        .into_iter()
        .filter(|(k, _)| *k != "status_policy" || given.contains_key("status_policy"))
        .map(|(k, v)| {
            let source = match given.get(k) {
                Some(offset) => Source::Route(*offset),
                None if k == "key_header" && given.contains_key("key_json_pointer") => {
                    Source::Route(given["key_json_pointer"])
                }
                None if k == "key_json_pointer" && given.contains_key("key_header") => {
                    Source::Route(given["key_header"])
                }
                None if k == "statuses" && given.contains_key("status_policy") => {
                    Source::Route(given["status_policy"])
                }
                None if INHERITED.contains(&k) => Source::Inherited,
                None => Source::Default,
            };
            Setting {
                key: k.to_owned(),
                value: v,
                source,
            }
        })
        .collect()
}

fn disposition_name(d: Disposition) -> &'static str {
    match d {
        Disposition::Store => "store",
        Disposition::Release => "release",
        Disposition::Hold => "hold",
    }
}

/// The JSON Schema (draft 2020-12) of the file: the top-level keys from
/// [`file_keys`] (clap's definitions), the route keys from [`ROUTE_KEYS`].
/// docs/config.schema.json is its pretty-printed output.
pub fn schema() -> serde_json::Value {
    use serde_json::{json, Map, Value};
    let mut props = Map::new();
    for fk in file_keys() {
        let mut p = match fk.kind {
            KeyKind::Flag => json!({ "type": "boolean" }),
            // An empty array is refused where it would mean a
            // non-empty default.
            KeyKind::List if !fk.default.is_empty() => json!({
                "anyOf": [
                    { "type": "array", "items": { "type": "string" }, "minItems": 1 },
                    { "type": "string", "description": "comma-separated" }
                ]
            }),
            KeyKind::List => json!({
                "anyOf": [
                    { "type": "array", "items": { "type": "string" } },
                    { "type": "string", "description": "comma-separated" }
                ]
            }),
            KeyKind::One => match fk.value_name.as_deref() {
                Some("N") => json!({ "type": "integer", "minimum": 0 }),
                Some("BYTES") => json!({ "type": ["string", "integer"] }),
                _ => json!({ "type": "string" }),
            },
        };
        let obj = p.as_object_mut().expect("an object");
        obj.insert("description".into(), Value::String(schema_text(&fk.help)));
        if let Some(env) = &fk.env {
            obj.insert("x-env".into(), Value::String(env.clone()));
        }
        obj.insert("x-flag".into(), Value::String(format!("--{}", fk.long)));
        match (fk.kind, fk.default.as_slice()) {
            (KeyKind::Flag, _) => {
                obj.insert("default".into(), Value::Bool(false));
            }
            (_, []) => {}
            (KeyKind::List, d) => {
                obj.insert(
                    "default".into(),
                    Value::Array(
                        d.iter()
                            .flat_map(|v| v.split(','))
                            .map(|v| Value::String(v.to_owned()))
                            .collect(),
                    ),
                );
            }
            (_, [d, ..]) => {
                let v = match fk.value_name.as_deref() {
                    Some("N") => d
                        .parse::<u64>()
                        .map(Value::from)
                        .unwrap_or(Value::String(d.clone())),
                    _ => Value::String(d.clone()),
                };
                obj.insert("default".into(), v);
            }
        }
        props.insert(fk.key, p);
    }
    props.insert(
        LOG_FORMAT_KEY.into(),
        json!({
            "enum": ["text", "json"],
            "default": "text",
            "description": "Log format (logs go to stderr): a flag of `idem` itself (`idem --log-format json gateway`); the flag and IDEM_LOG_FORMAT win over the file. Read at start only.",
            "x-env": "IDEM_LOG_FORMAT",
            "x-flag": "--log-format"
        }),
    );
    let mut route_props = Map::new();
    for rk in ROUTE_KEYS {
        let mut p = match rk.ty {
            RouteKeyType::String => json!({ "type": "string" }),
            RouteKeyType::Bool => json!({ "type": "boolean" }),
            RouteKeyType::Duration => {
                json!({ "type": "string", "examples": ["24h", "60s", "500ms"] })
            }
            RouteKeyType::Size => {
                json!({ "type": ["string", "integer"], "examples": ["1MiB", 65536] })
            }
            RouteKeyType::Strings if ["methods", "scope_headers"].contains(&rk.key) => {
                json!({ "type": "array", "items": { "type": "string" }, "minItems": 1 })
            }
            RouteKeyType::Strings => json!({ "type": "array", "items": { "type": "string" } }),
            RouteKeyType::Enum(values) => json!({ "enum": values }),
            RouteKeyType::Statuses => json!({
                "type": "object",
                "propertyNames": { "pattern": "^([1-9][0-9][0-9]|[1-9][xX][xX])$" },
                "additionalProperties": { "enum": ["store", "release", "hold"] }
            }),
        };
        let obj = p.as_object_mut().expect("an object");
        obj.insert(
            "description".into(),
            Value::String(format!("{} Default: {}.", rk.doc, rk.default)),
        );
        route_props.insert(rk.key.to_owned(), p);
    }
    props.insert(
        "routes".into(),
        json!({
            "description": "Per-route rules, first match wins (method and path); a request no route matches gets the top-level settings (route `default`).",
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "path"],
                "additionalProperties": false,
                "not": { "required": ["key_header", "key_json_pointer"] },
                "properties": Value::Object(route_props)
            }
        }),
    );
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "urn:idem:gateway-config",
        "title": "idem gateway configuration file",
        "description": "The file of `idem gateway --config FILE` (TOML 1.0). Top-level keys are the gateway flags with '-' written '_'; flags and IDEM_* variables override the file. See docs/CONFIG.md.",
        "type": "object",
        "additionalProperties": false,
        "properties": Value::Object(props)
    })
}

/// Help text on one line.
fn schema_text(help: &str) -> String {
    help.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(args: &[&str]) -> ArgMatches {
        let mut v = vec!["idem-gateway"];
        v.extend_from_slice(args);
        gateway_command().try_get_matches_from(v).unwrap()
    }

    fn load_text(args: &[&str], text: &str) -> Result<Loaded, LoadError> {
        load_str(&matches(args), Path::new("idem.toml"), text)
    }

    #[test]
    fn every_flag_has_a_key() {
        let keys = file_keys();
        for k in [
            "upstream",
            "store",
            "ttl",
            "scope_header",
            "require_key",
            "trusted_proxy",
            "otlp_endpoint",
        ] {
            assert!(keys.iter().any(|fk| fk.key == k), "{k}");
        }
        assert!(!keys.iter().any(|fk| fk.key == "config"));
        let kind = |k: &str| keys.iter().find(|fk| fk.key == k).unwrap().kind;
        assert_eq!(kind("require_key"), KeyKind::Flag);
        assert_eq!(kind("scope_header"), KeyKind::List);
        assert_eq!(kind("ttl"), KeyKind::One);
    }

    #[test]
    fn file_values_and_sources() {
        let text = "upstream = \"http://127.0.0.1:3000\"\nstore = \"memory://\"\nttl = \"2h\"\nrequire_key = true\nscope_header = [\"x-api-key\", \"X-Tenant\"]\nmax_body = 2048\n";
        let l = load_text(&["--ttl", "3h"], text).unwrap();
        assert_eq!(l.config.layer.ttl, std::time::Duration::from_secs(3 * 3600));
        assert!(l.config.layer.require_key);
        assert_eq!(l.config.layer.max_body, 2048);
        let src = |k: &str| {
            l.report
                .settings
                .iter()
                .find(|s| s.key == k)
                .unwrap()
                .source
                .clone()
        };
        assert_eq!(src("ttl"), Source::Flag);
        assert_eq!(src("require_key"), Source::File(4));
        assert_eq!(src("scope_header"), Source::File(5));
        assert_eq!(src("lease"), Source::Default);
        assert_eq!(l.report.value("scope_header"), Some("x-api-key,X-Tenant"));
    }

    #[test]
    fn flags_that_require_each_other_work_from_the_file() {
        use idem_testkit::pki::{TestCa, Usage};
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("file CA");
        let ca_path = ca.write(dir.path(), "ca.crt");
        let (s_crt, s_key) = ca
            .issue(&["localhost"], Usage::Server)
            .write(dir.path(), "s");
        let (c_crt, c_key) = ca.issue(&["client"], Usage::Client).write(dir.path(), "c");
        let text = format!(
            "upstream = \"https://127.0.0.1:3443\"\ntls_cert = {s_crt:?}\ntls_key = {s_key:?}\n\
             tls_client_ca = {ca_path:?}\nscope_from = \"client-cert\"\n\
             upstream_client_cert = {c_crt:?}\nupstream_client_key = {c_key:?}\n"
        );
        let text = text.as_str();
        let l = load_text(&[], text).unwrap();
        let tls = l
            .config
            .tls
            .as_ref()
            .expect("the listener's TLS from the file");
        assert_eq!(tls.cert, s_crt);
        assert_eq!(tls.client_ca.as_deref(), Some(ca_path.as_path()));
        assert_eq!(
            l.config.upstream_tls.client_key.as_deref(),
            Some(c_key.as_path())
        );
        // One of a pair alone is refused, naming the other.
        for (text, other) in [
            (
                "upstream = \"http://x:1\"\ntls_cert = \"s.crt\"\n",
                "tls-key",
            ),
            (
                "upstream = \"https://x:1\"\nupstream_client_key = \"c.key\"\n",
                "upstream-client-cert",
            ),
        ] {
            let Err(e) = load_text(&[], text) else {
                panic!("{text}: accepted");
            };
            let e = e.to_string();
            assert!(e.contains(other), "{text}: {e}");
        }
    }

    #[test]
    fn errors_carry_the_line() {
        let cases = [
            ("upstream = \"http://x:1\"\nttls = \"1h\"\n", 2, "unknown key `ttls`"),
            ("upstream = \"http://x:1\"\n\nttl = \"soon\"\n", 3, "`ttl`"),
            ("upstream = \"http://x:1\"\nrequire_key = \"yes\"\n", 2, "expected a boolean"),
            ("upstream = \"http://x:1\"\nrequire-key = true\n", 2, "write it `require_key`"),
            ("upstream = \"http://x:1\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nttll = \"1h\"\n", 5, "unknown route key `ttll`"),
            ("upstream = \"http://x:1\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nttl = \"1s\"\n", 2, "ttl (1s) is shorter"),
            ("upstream = \"http://x:1\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nkey_header = \"k\"\nkey_json_pointer = \"/k\"\n", 6, "exclude each other"),
            ("upstream = \"http://x:1\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nstatuses = { \"6yy\" = \"hold\" }\n", 5, "6yy"),
            ("upstream = \"http://x:1\"\nttl = [\n", 2, "TOML"),
            ("upstream = \"http://x:1\"\nscope_header = []\n", 2, "`scope_header`: names no header"),
            ("upstream = \"http://x:1\"\n\nmethods = []\n", 3, "`methods`: names no method"),
        ];
        for (text, line, needle) in cases {
            match load_text(&["--store", "memory://"], text) {
                Err(LoadError::At {
                    line: l, message, ..
                }) => {
                    assert!(message.contains(needle), "{text}: {message}");
                    assert!(l == line || needle == "TOML", "{text}: line {l}, {message}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            load_text(&["--store", "memory://"], "ttl = \"1h\"\n"),
            Err(LoadError::Config(ConfigError::NoUpstream))
        ));
        // A combination refused after layering names the file's line.
        match load_text(
            &["--store", "memory://"],
            "upstream = \"http://x:1\"\n\nlease = \"500ms\"\n",
        ) {
            Err(LoadError::At {
                line: 3, message, ..
            }) => {
                assert!(message.starts_with("`lease`: --lease (500ms)"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        // From a flag: no line.
        assert!(matches!(
            load_text(
                &["--store", "memory://", "--lease", "500ms"],
                "upstream = \"http://x:1\"\n"
            ),
            Err(LoadError::Config(ConfigError::LeaseTooShort { .. }))
        ));
    }

    #[test]
    fn an_empty_list_whose_default_is_none_is_none() {
        let l = load_text(
            &["--store", "memory://"],
            "upstream = \"http://x:1\"\ntrusted_proxy = []\nrequire_token = []\n",
        )
        .unwrap();
        assert_eq!(l.report.value("trusted_proxy"), Some(""));
        assert!(l.config.layer.require_token.is_empty());
    }

    #[test]
    fn a_reload_refuses_an_empty_file_and_any_load_a_large_one() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("idem.toml");
        let m = matches(&["--upstream", "http://x:1", "--store", "memory://"]);
        for blank in ["", "  \n\t\n", "# only a comment\n\n   # another\n"] {
            std::fs::write(&f, blank).unwrap();
            assert!(is_blank(blank));
            // The start takes it (the flags say everything) …
            load(&m, &f).unwrap();
            // … a reload does not.
            match load_for_reload(&m, &f) {
                Err(e @ LoadError::Empty { .. }) => {
                    assert!(
                        e.to_string().contains("the configuration file is empty"),
                        "{e}"
                    )
                }
                other => panic!("{blank:?}: {other:?}"),
            }
        }
        assert!(!is_blank("# c\nttl = \"1h\"\n"));
        std::fs::write(&f, "ttl = \"1h\"\n").unwrap();
        load_for_reload(&m, &f).unwrap();
        // Over the limit, at start and on reload, without parsing.
        let mut big = String::from("ttl = \"1h\"\n");
        big.push_str(&"# padding\n".repeat((MAX_CONFIG_FILE as usize) / 10 + 1));
        std::fs::write(&f, &big).unwrap();
        for r in [load(&m, &f), load_for_reload(&m, &f)] {
            match r {
                Err(e @ LoadError::TooLarge { .. }) => {
                    assert!(e.to_string().contains("larger than 1048576 bytes"), "{e}")
                }
                other => panic!("{other:?}"),
            }
        }
        // Exactly the limit is read.
        big.truncate(MAX_CONFIG_FILE as usize);
        std::fs::write(&f, &big).unwrap();
        assert_eq!(read(&f).unwrap().len() as u64, MAX_CONFIG_FILE);
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert!(matches!(read(&f), Err(LoadError::Read { .. })));
    }

    #[test]
    fn routes_inherit_and_override() {
        let text = r#"
upstream = "http://127.0.0.1:3000"
store = "memory://"
lease = "10s"

[[routes]]
name = "payments"
methods = ["POST"]
path = "/payments"
require_key = true
ttl = "24h"
lease = "60s"
status_policy = "store-5xx"
statuses = { "504" = "release" }

[[routes]]
name = "carts"
path = "/carts"
guard = false

[[routes]]
name = "webhooks"
path = "/webhooks"
key_json_pointer = "/event_id"
fingerprint_exclude = ["/delivered_at"]
require_token = true
"#;
        let l = load_text(&[], text).unwrap();
        let r = &l.config.routes;
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].options.lease, std::time::Duration::from_secs(60));
        assert!(r[0].options.require_key);
        assert_eq!(
            r[0].options
                .policy
                .disposition(http::StatusCode::INTERNAL_SERVER_ERROR),
            Disposition::Store
        );
        assert_eq!(
            r[0].options
                .policy
                .disposition(http::StatusCode::GATEWAY_TIMEOUT),
            Disposition::Release
        );
        assert!(!r[1].guard);
        assert_eq!(
            r[1].options.lease,
            std::time::Duration::from_secs(10),
            "inherited"
        );
        assert_eq!(
            r[2].options.key_source,
            KeySource::JsonPointer("/event_id".into())
        );
        assert_eq!(r[2].options.fingerprint.exclude, vec!["/delivered_at"]);
        assert_eq!(r[2].options.fingerprint.route, "webhooks");
        assert!(l.config.tokens_served());
        assert_eq!(l.report.routes.len(), 4);
        assert_eq!(l.report.routes[3].name, "default");
        assert_eq!(l.report.routes[0].line, Some(6));
        let shown = l.report.to_string();
        assert!(shown.contains("route:12"), "{shown}");
        assert!(shown.contains("3 routes + default"), "{shown}");
        // A key with a top-level setting is inherited; one without has
        // the route key's default.
        let source = |route: usize, key: &str| {
            l.report.routes[route]
                .settings
                .iter()
                .find(|s| s.key == key)
                .unwrap()
                .source
                .clone()
        };
        assert_eq!(source(1, "lease"), Source::Inherited);
        assert_eq!(source(1, "scope_headers"), Source::Inherited);
        assert_eq!(source(1, "key_header"), Source::Default);
        assert_eq!(source(3, "guard"), Source::Default);
        assert_eq!(source(3, "ttl"), Source::Inherited);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn the_store_password_is_not_shown() {
        let l = load_text(
            &["--store", "postgres://idem:s3cret@db/app"],
            "upstream = \"http://x:1\"\n",
        )
        .unwrap();
        assert_eq!(l.report.value("store"), Some("postgres://idem:***@db/app"));
        assert!(!l.report.to_string().contains("s3cret"));
        assert!(!format!("{:?}", l.config).contains("s3cret"));
    }

    #[test]
    fn schema_names_every_key() {
        let s = schema();
        let props = s["properties"].as_object().unwrap();
        for fk in file_keys() {
            assert!(props.contains_key(&fk.key), "{}", fk.key);
        }
        let route = props["routes"]["items"]["properties"].as_object().unwrap();
        assert_eq!(route.len(), ROUTE_KEYS.len());
    }
}
