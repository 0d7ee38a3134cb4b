//! Key and channel names of one record.

use idem_core::{IdempotencyKey, Scope};
use sha2::{Digest, Sha256};

/// The Redis names of one scoped key's record.
///
/// All share the hash tag `{<prefix>:<hex>}` where `<hex>` is the lowercase
/// hex SHA-256 of `u64be(len(scope)) ‖ scope ‖ key`. The tag is the part of
/// a name between the first `{` and the next `}`, so on a Cluster the
/// record, its fence counter and its channel map to one slot. No user byte
/// reaches a name (scopes may hold `{`, `}` or anything else); the length
/// prefix keeps `("ab", "c")` and `("a", "bc")` apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RecordKeys {
    /// `{tag}:r` — the record, a hash.
    pub(crate) record: String,
    /// `{tag}:f` — the fence counter, a string.
    pub(crate) fence: String,
    /// `{tag}:chg` — the pub/sub channel that `complete`, `release`,
    /// `delete` and purging publish on.
    pub(crate) channel: String,
}

impl RecordKeys {
    pub(crate) fn new(prefix: &str, scope: &Scope, key: &IdempotencyKey) -> Self {
        let mut h = Sha256::new();
        h.update((scope.as_str().len() as u64).to_be_bytes());
        h.update(scope.as_str().as_bytes());
        h.update(key.as_str().as_bytes());
        let tag = format!("{{{prefix}:{}}}", hex::encode(h.finalize()));
        Self {
            record: format!("{tag}:r"),
            fence: format!("{tag}:f"),
            channel: format!("{tag}:chg"),
        }
    }

    /// The channel of a record key found by `SCAN` (`{tag}:r` → `{tag}:chg`).
    pub(crate) fn channel_of(record: &str) -> String {
        format!("{}:chg", record.strip_suffix(":r").unwrap_or(record))
    }
}

/// The `SCAN MATCH` pattern of every record under `prefix`: exactly 64
/// characters of hash, so a longer prefix that starts with this one
/// (`idem:x` under `idem`) is not matched.
pub(crate) fn record_pattern(prefix: &str) -> String {
    format!("{{{prefix}:{}}}:r", "?".repeat(64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(scope: &str, key: &str) -> RecordKeys {
        RecordKeys::new(
            "idem",
            &Scope::new(scope).expect("scope"),
            &IdempotencyKey::new(key).expect("key"),
        )
    }

    /// The Cluster hash tag: the text between the first `{` and the next `}`.
    fn tag(name: &str) -> &str {
        let open = name.find('{').expect("{");
        let close = open + name[open..].find('}').expect("}");
        &name[open + 1..close]
    }

    #[test]
    fn one_tag_per_record_and_no_user_bytes() {
        let r = k("tenant {a}", "key {with} braces");
        assert_eq!(tag(&r.record), tag(&r.fence));
        assert_eq!(tag(&r.record), tag(&r.channel));
        assert!(tag(&r.record).starts_with("idem:"));
        assert_eq!(tag(&r.record).len(), "idem:".len() + 64);
        assert!(!r.record.contains("tenant") && !r.record.contains("braces"));
        assert!(r.record.ends_with("}:r") && r.fence.ends_with("}:f"));
        assert_eq!(RecordKeys::channel_of(&r.record), r.channel);
    }

    #[test]
    fn scope_and_key_are_delimited() {
        assert_ne!(k("ab", "c").record, k("a", "bc").record);
        assert_ne!(k("", "ab").record, k("a", "b").record);
        assert_ne!(k("s", "k").record, k("s", "k ").record);
        assert_eq!(k("s", "k"), k("s", "k"));
    }

    #[test]
    fn pattern_matches_only_this_prefix() {
        let p = record_pattern("idem");
        assert_eq!(p.len(), "{idem:}:r".len() + 64);
        assert!(p.starts_with("{idem:") && p.ends_with("}:r"));
    }
}
