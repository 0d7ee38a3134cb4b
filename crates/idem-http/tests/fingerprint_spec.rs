//! Per-route fingerprints ([`FingerprintSpec`], [`request_fingerprint_with`]):
//! the default spec is today's fingerprint bit for bit, every other spec
//! has a space of its own, and each part can be turned off or narrowed.

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use idem_core::Fingerprint;
use idem_http::fingerprint::{
    request_fingerprint, request_fingerprint_with, FingerprintSpec, FingerprintSpecError,
};
use proptest::prelude::*;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (n, v) in pairs {
        h.append(
            HeaderName::from_bytes(n.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn json_headers() -> HeaderMap {
    headers(&[("content-type", "application/json")])
}

/// The fingerprint of a POST under `spec` with a JSON content type.
fn fp(spec: &FingerprintSpec, uri: &str, body: &str) -> Fingerprint {
    fp_with(spec, &Method::POST, uri, &json_headers(), body)
}

fn fp_with(
    spec: &FingerprintSpec,
    method: &Method,
    uri: &str,
    h: &HeaderMap,
    body: &str,
) -> Fingerprint {
    let uri: Uri = uri.parse().unwrap();
    request_fingerprint_with(spec, method, &uri, h, body.as_bytes())
}

fn spec() -> FingerprintSpec {
    FingerprintSpec::default()
}

#[test]
fn default_spec_is_the_plain_fingerprint() {
    let h = json_headers();
    for route in ["", "payments", "default"] {
        let s = FingerprintSpec {
            route: route.into(),
            ..spec()
        };
        assert!(s.is_default());
        for (uri, body) in [
            ("/orders", r#"{"b":1,"a":2}"#),
            ("/orders?x=1&y=2", "not json"),
            ("/orders?", ""),
        ] {
            assert_eq!(
                fp(&s, uri, body),
                request_fingerprint(&Method::POST, &uri.parse().unwrap(), &h, body.as_bytes())
            );
        }
    }
}

#[test]
fn a_semicolon_keeps_an_ignored_parameter() {
    let s = FingerprintSpec {
        ignore_query: vec!["utm_source".into()],
        ..spec()
    };
    assert_ne!(
        fp(&s, "/q?utm_source=x;amount=100", "{}"),
        fp(&s, "/q?utm_source=x;amount=999", "{}")
    );
}

#[test]
fn ignored_query_params() {
    let s = FingerprintSpec {
        ignore_query: vec!["utm_source".into(), "utm medium".into()],
        ..spec()
    };
    let body = "{}";
    let base = fp(&s, "/p?a=1", body);
    for same in [
        "/p?a=1&utm_source=x",
        "/p?utm_source=x&a=1",
        "/p?utm_source&a=1",
        "/p?utm_source=&a=1&utm_source=y",
        "/p?utm%5Fsource=x&a=1",
        "/p?a=1&utm+medium=z",
        "/p?a=1&utm%20medium=z",
        "/p?a=1&utm_source=x=y",
    ] {
        assert_eq!(base, fp(&s, same, body), "{same}");
    }
    for other in [
        "/p?a=2",
        "/p?a=1&b=2",
        "/p?a=1&UTM_SOURCE=x",
        "/p?a=1&utm_sourc=x",
        "/p?a=1&utm_source2=x",
        "/p?a=1&",
        "/p?a=1&utm%2Bmedium=z",
        "/p?a=%31",
        "/p",
        // `;` separates parameters for some servers: never left out.
        "/p?a=1&utm_source=x;b=2",
        "/p?utm_source=x;a=1",
    ] {
        assert_ne!(base, fp(&s, other, body), "{other}");
    }
    // The other parameters keep their order.
    assert_ne!(fp(&s, "/p?a=1&b=2", body), fp(&s, "/p?b=2&a=1", body));
    assert_eq!(
        fp(&s, "/p?a=1&utm_source=q&b=2", body),
        fp(&s, "/p?a=1&b=2", body)
    );
    // A query of ignored parameters only is no query; `?` alone is not.
    assert_eq!(fp(&s, "/p?utm_source=x", body), fp(&s, "/p", body));
    assert_ne!(fp(&s, "/p?", body), fp(&s, "/p", body));
    // A malformed escape stays as written.
    assert_ne!(fp(&s, "/p?utm%5source=1", body), fp(&s, "/p", body));
}

#[test]
fn query_off_and_method_off() {
    let no_query = FingerprintSpec {
        query: false,
        ..spec()
    };
    assert_eq!(fp(&no_query, "/p?a=1", "{}"), fp(&no_query, "/p?b=2", "{}"));
    assert_eq!(fp(&no_query, "/p?", "{}"), fp(&no_query, "/p", "{}"));
    assert_ne!(fp(&no_query, "/p", "{}"), fp(&no_query, "/q", "{}"));

    let no_method = FingerprintSpec {
        method: false,
        ..spec()
    };
    let h = json_headers();
    assert_eq!(
        fp_with(&no_method, &Method::POST, "/p", &h, "{}"),
        fp_with(&no_method, &Method::PATCH, "/p", &h, "{}")
    );
    assert_ne!(
        fp_with(&no_method, &Method::POST, "/p", &h, "{}"),
        fp_with(&no_method, &Method::POST, "/q", &h, "{}")
    );
    let with_method = FingerprintSpec {
        query: false,
        ..spec()
    };
    assert_ne!(
        fp_with(&with_method, &Method::POST, "/p", &h, "{}"),
        fp_with(&with_method, &Method::PATCH, "/p", &h, "{}")
    );
}

#[test]
fn path_off_counts_the_route_name() {
    let payments = FingerprintSpec {
        path: false,
        route: "payments".into(),
        ..spec()
    };
    let refunds = FingerprintSpec {
        route: "refunds".into(),
        ..payments.clone()
    };
    assert_eq!(
        fp(&payments, "/payments/1", "{}"),
        fp(&payments, "/payments/2", "{}")
    );
    assert_ne!(
        fp(&payments, "/payments/1", "{}"),
        fp(&refunds, "/payments/1", "{}")
    );
    // With the path on, the route's name does not count.
    let a = FingerprintSpec {
        query: false,
        route: "a".into(),
        ..spec()
    };
    let b = FingerprintSpec {
        route: "b".into(),
        ..a.clone()
    };
    assert_eq!(fp(&a, "/x", "{}"), fp(&b, "/x", "{}"));
    assert_ne!(fp(&a, "/x", "{}"), fp(&a, "/y", "{}"));
}

#[test]
fn named_headers_count() {
    let s = FingerprintSpec {
        headers: vec![
            HeaderName::from_static("x-tenant"),
            HeaderName::from_static("x-region"),
        ],
        ..spec()
    };
    let with = |pairs: &[(&str, &str)]| {
        let mut h = json_headers();
        h.extend(headers(pairs));
        fp_with(&s, &Method::POST, "/p", &h, "{}")
    };
    let base = with(&[("x-tenant", "t1"), ("x-region", "eu")]);
    assert_eq!(base, with(&[("x-region", "eu"), ("x-tenant", "t1")]));
    assert_eq!(
        base,
        with(&[("x-tenant", "t1"), ("x-region", "eu"), ("x-other", "z")]),
        "headers not named do not count"
    );
    assert_ne!(base, with(&[("x-tenant", "t2"), ("x-region", "eu")]));
    assert_ne!(base, with(&[("x-tenant", "t1")]));
    assert_ne!(base, with(&[("x-tenant", "t1eu")]));
    assert_ne!(base, with(&[("x-tenant", "t1"), ("x-tenant", "eu")]));
    // Absent differs from empty; field order counts.
    assert_ne!(with(&[]), with(&[("x-tenant", "")]));
    assert_ne!(
        with(&[("x-tenant", "a"), ("x-tenant", "b")]),
        with(&[("x-tenant", "b"), ("x-tenant", "a")])
    );
    assert_ne!(
        with(&[("x-tenant", "a,b")]),
        with(&[("x-tenant", "a"), ("x-tenant", "b")])
    );
    // Content-Type still counts.
    let mut text = headers(&[("content-type", "text/plain")]);
    text.extend(headers(&[("x-tenant", "t1"), ("x-region", "eu")]));
    assert_ne!(base, fp_with(&s, &Method::POST, "/p", &text, "{}"));
}

#[test]
fn excluded_fields() {
    let s = FingerprintSpec {
        exclude: vec!["/delivered_at".into(), "/meta/attempt".into()],
        ..spec()
    };
    let base = fp(&s, "/hooks", r#"{"id":1,"delivered_at":"x"}"#);
    assert_eq!(base, fp(&s, "/hooks", r#"{"delivered_at":"y","id":1}"#));
    assert_eq!(base, fp(&s, "/hooks", r#"{"id":1}"#));
    assert_eq!(base, fp(&s, "/hooks", r#"{ "id" : 1.0 }"#));
    assert_ne!(base, fp(&s, "/hooks", r#"{"id":2,"delivered_at":"x"}"#));
    assert_ne!(base, fp(&s, "/hooks", r#"{"id":1,"delivered":"x"}"#));
    assert_eq!(
        fp(
            &s,
            "/hooks",
            r#"{"id":1,"meta":{"attempt":1,"source":"a"}}"#
        ),
        fp(
            &s,
            "/hooks",
            r#"{"meta":{"source":"a","attempt":7},"id":1}"#
        )
    );
    assert_ne!(
        fp(
            &s,
            "/hooks",
            r#"{"id":1,"meta":{"attempt":1,"source":"a"}}"#
        ),
        fp(
            &s,
            "/hooks",
            r#"{"id":1,"meta":{"attempt":1,"source":"b"}}"#
        )
    );
    // Through a non-object, a pointer finds nothing.
    assert_ne!(
        fp(&s, "/hooks", r#"{"id":1,"meta":"a"}"#),
        fp(&s, "/hooks", r#"{"id":1,"meta":"b"}"#)
    );
    // The query and path still count.
    assert_ne!(base, fp(&s, "/hooks?x", r#"{"id":1,"delivered_at":"x"}"#));
}

#[test]
fn excluded_array_elements_resolve_against_the_body_as_received() {
    let s = FingerprintSpec {
        exclude: vec!["/items/1".into(), "/items/0".into(), "/items/2/at".into()],
        ..spec()
    };
    let base = fp(&s, "/p", r#"{"items":[1,2,{"at":1,"v":3},4]}"#);
    assert_eq!(base, fp(&s, "/p", r#"{"items":[9,8,{"at":2,"v":3},4]}"#));
    assert_ne!(base, fp(&s, "/p", r#"{"items":[1,2,{"at":1,"v":3},5]}"#));
    assert_ne!(base, fp(&s, "/p", r#"{"items":[1,2,{"at":1,"v":4},4]}"#));
    assert_ne!(base, fp(&s, "/p", r#"{"items":[1,2,4]}"#));
    // Array order still matters for what is kept.
    assert_ne!(
        fp(&s, "/p", r#"{"items":[0,0,{},1,2]}"#),
        fp(&s, "/p", r#"{"items":[0,0,{},2,1]}"#)
    );
    // `-` and leading zeros are no index.
    let odd = FingerprintSpec {
        exclude: vec!["/items/-".into(), "/items/01".into()],
        ..spec()
    };
    assert_ne!(
        fp(&odd, "/p", r#"{"items":[1,2]}"#),
        fp(&odd, "/p", r#"{"items":[1,3]}"#)
    );
    assert_eq!(
        fp(&odd, "/p", r#"{"items":{"01":1,"-":2,"k":3}}"#),
        fp(&odd, "/p", r#"{"items":{"01":5,"k":3}}"#),
        "on an object they are member names"
    );
    // `/items/0` of the body as received, twice: one element.
    let twice = FingerprintSpec {
        exclude: vec!["/items/0".into(), "/items/0".into()],
        ..spec()
    };
    assert_ne!(
        fp(&twice, "/p", r#"{"items":[1,2]}"#),
        fp(&twice, "/p", r#"{"items":[1,3]}"#)
    );
}

#[test]
fn rfc_6901_escapes() {
    let s = FingerprintSpec {
        exclude: vec!["/a~1b".into(), "/c~0d".into(), "/~01".into()],
        ..spec()
    };
    assert_eq!(
        fp(&s, "/p", r#"{"k":1,"a/b":1,"c~d":1,"~1":1}"#),
        fp(&s, "/p", r#"{"k":1,"a/b":2,"c~d":2,"~1":2}"#)
    );
    assert_ne!(
        fp(&s, "/p", r#"{"k":1,"a":{"b":1}}"#),
        fp(&s, "/p", r#"{"k":1,"a":{"b":2}}"#),
        "~1 is a slash inside one token"
    );
    assert_ne!(
        fp(&s, "/p", r#"{"k":1,"/":1}"#),
        fp(&s, "/p", r#"{"k":1,"/":2}"#),
        "~01 is the name ~1"
    );
}

#[test]
fn excluding_the_whole_document() {
    let s = FingerprintSpec {
        exclude: vec![String::new()],
        ..spec()
    };
    assert_eq!(fp(&s, "/p", r#"{"a":1}"#), fp(&s, "/p", "[2]"));
    assert_ne!(
        fp(&s, "/p", r#"{"a":1}"#),
        fp(&s, "/p", "{"),
        "not JSON: raw"
    );
}

#[test]
fn included_fields() {
    let s = FingerprintSpec {
        include: vec!["/amount".into(), "/currency".into()],
        ..spec()
    };
    let base = fp(&s, "/pay", r#"{"amount":10,"currency":"EUR","note":"a"}"#);
    assert_eq!(
        base,
        fp(&s, "/pay", r#"{"note":"b","currency":"EUR","amount":1e1}"#)
    );
    assert_eq!(base, fp(&s, "/pay", r#"{"amount":10,"currency":"EUR"}"#));
    assert_ne!(base, fp(&s, "/pay", r#"{"amount":11,"currency":"EUR"}"#));
    assert_ne!(base, fp(&s, "/pay", r#"{"amount":10,"currency":"USD"}"#));
    // Missing differs from null, and a value does not move to another pointer.
    assert_ne!(
        fp(&s, "/pay", r#"{"amount":10}"#),
        fp(&s, "/pay", r#"{"amount":10,"currency":null}"#)
    );
    assert_ne!(
        fp(&s, "/pay", r#"{"amount":"EUR"}"#),
        fp(&s, "/pay", r#"{"currency":"EUR"}"#)
    );
    // An included object is canonicalised whole.
    let nested = FingerprintSpec {
        include: vec!["/order".into(), "/items/0".into()],
        ..spec()
    };
    assert_eq!(
        fp(
            &nested,
            "/p",
            r#"{"order":{"b":1,"a":2},"items":[{"x":1},2],"z":0}"#
        ),
        fp(
            &nested,
            "/p",
            r#"{"items":[{"x":1.0},3],"order":{"a":2,"b":1}}"#
        )
    );
    assert_ne!(
        fp(
            &nested,
            "/p",
            r#"{"order":{"b":1,"a":2},"items":[{"x":1},2]}"#
        ),
        fp(
            &nested,
            "/p",
            r#"{"order":{"b":1,"a":[2]},"items":[{"x":1},2]}"#
        )
    );
}

#[test]
fn bodies_that_are_not_i_json_are_hashed_raw_whole() {
    for s in [
        FingerprintSpec {
            exclude: vec!["/delivered_at".into()],
            ..spec()
        },
        FingerprintSpec {
            include: vec!["/id".into()],
            ..spec()
        },
    ] {
        // Not JSON by content type.
        let text = headers(&[("content-type", "text/plain")]);
        assert_ne!(
            fp_with(
                &s,
                &Method::POST,
                "/p",
                &text,
                r#"{"id":1,"delivered_at":"x"}"#
            ),
            fp_with(
                &s,
                &Method::POST,
                "/p",
                &text,
                r#"{"id":1,"delivered_at":"y"}"#
            )
        );
        // Two content types: not read as JSON.
        let two = headers(&[
            ("content-type", "application/json"),
            ("content-type", "application/json"),
        ]);
        assert_ne!(
            fp_with(
                &s,
                &Method::POST,
                "/p",
                &two,
                r#"{"id":1,"delivered_at":"x"}"#
            ),
            fp_with(
                &s,
                &Method::POST,
                "/p",
                &two,
                r#"{"id":1,"delivered_at":"y"}"#
            )
        );
        // Not I-JSON: duplicate names, an inexact number (even in a part
        // left out), malformed.
        for (a, b) in [
            (
                r#"{"id":1,"id":2,"delivered_at":"x"}"#,
                r#"{"id":1,"id":2,"delivered_at":"y"}"#,
            ),
            (
                r#"{"id":1,"delivered_at":0.1000000000000000001}"#,
                r#"{"id":1,"delivered_at":0.1000000000000000002}"#,
            ),
            (
                r#"{"id":1,"delivered_at":9007199254740993}"#,
                r#"{"id":1,"delivered_at":9007199254740994}"#,
            ),
            (
                r#"{"id":1,"delivered_at":"x""#,
                r#"{"id":1,"delivered_at":"y""#,
            ),
        ] {
            assert_ne!(fp(&s, "/p", a), fp(&s, "/p", b), "{a}");
        }
        // The raw body is the whole body: whitespace counts.
        assert_ne!(
            fp_with(&s, &Method::POST, "/p", &text, r#"{"id":1}"#),
            fp_with(&s, &Method::POST, "/p", &text, r#"{ "id":1}"#)
        );
    }
}

#[test]
fn body_off() {
    let s = FingerprintSpec {
        body: false,
        ..spec()
    };
    assert_eq!(fp(&s, "/p", r#"{"a":1}"#), fp(&s, "/p", "anything"));
    assert_ne!(fp(&s, "/p", "{}"), fp(&s, "/q", "{}"));
    assert_ne!(
        fp(&s, "/p", "{}"),
        fp_with(&s, &Method::POST, "/p", &HeaderMap::new(), "{}"),
        "Content-Type still counts"
    );
}

/// Every spec below sees the same request; none of them may share a
/// fingerprint with another, even where the parts they hash coincide.
#[test]
fn two_specs_never_share_a_fingerprint() {
    let h = |n: &'static str| HeaderName::from_static(n);
    let specs = vec![
        spec(),
        FingerprintSpec {
            method: false,
            ..spec()
        },
        FingerprintSpec {
            path: false,
            ..spec()
        },
        FingerprintSpec {
            path: false,
            route: "/p".into(),
            ..spec()
        },
        FingerprintSpec {
            query: false,
            ..spec()
        },
        FingerprintSpec {
            body: false,
            ..spec()
        },
        FingerprintSpec {
            method: false,
            path: false,
            query: false,
            body: false,
            ..spec()
        },
        FingerprintSpec {
            ignore_query: vec!["zzz".into()],
            ..spec()
        },
        FingerprintSpec {
            ignore_query: vec!["yyy".into()],
            ..spec()
        },
        FingerprintSpec {
            ignore_query: vec!["zz".into(), "z".into()],
            ..spec()
        },
        FingerprintSpec {
            ignore_query: vec!["z".into(), "zz".into()],
            ..spec()
        },
        FingerprintSpec {
            headers: vec![h("x-absent")],
            ..spec()
        },
        FingerprintSpec {
            headers: vec![h("x-other")],
            ..spec()
        },
        FingerprintSpec {
            headers: vec![h("x-absent"), h("x-other")],
            ..spec()
        },
        FingerprintSpec {
            exclude: vec!["/nothing".into()],
            ..spec()
        },
        FingerprintSpec {
            exclude: vec!["/none".into()],
            ..spec()
        },
        FingerprintSpec {
            exclude: vec!["/a".into(), "/b".into()],
            ..spec()
        },
        FingerprintSpec {
            exclude: vec!["/a/b".into()],
            ..spec()
        },
        FingerprintSpec {
            include: vec!["/a".into(), "/b".into()],
            ..spec()
        },
        FingerprintSpec {
            include: vec!["/a/b".into()],
            ..spec()
        },
        FingerprintSpec {
            include: vec!["".into()],
            ..spec()
        },
    ];
    let mut seen = std::collections::HashMap::new();
    for (i, s) in specs.iter().enumerate() {
        let f = fp(s, "/p?q=1", r#"{"k":1}"#);
        if let Some(j) = seen.insert(f, i) {
            panic!(
                "specs {j} and {i} share a fingerprint: {:?} / {s:?}",
                specs[j]
            );
        }
    }
    // A spec that changes nothing it hashes still has its own space.
    assert_ne!(
        fp(&specs[14], "/p", r#"{"k":1}"#),
        fp(&spec(), "/p", r#"{"k":1}"#)
    );
}

#[test]
fn validate_refuses_bad_specs() {
    let ok = [
        spec(),
        FingerprintSpec {
            exclude: vec!["".into(), "/".into(), "/a~0b/~1/0".into()],
            ..spec()
        },
        FingerprintSpec {
            include: vec!["/amount".into()],
            ..spec()
        },
        FingerprintSpec {
            body: false,
            query: false,
            method: false,
            path: false,
            ..spec()
        },
    ];
    for s in ok {
        assert_eq!(s.validate(), Ok(()), "{s:?}");
    }
    for p in ["delivered_at", "/a~2", "/a~", "#/a", "/~a"] {
        for s in [
            FingerprintSpec {
                exclude: vec!["/ok".into(), p.into()],
                ..spec()
            },
            FingerprintSpec {
                include: vec![p.into()],
                ..spec()
            },
        ] {
            match s.validate() {
                Err(FingerprintSpecError::Pointer { pointer, reason }) => {
                    assert_eq!(pointer, p);
                    assert!(!reason.is_empty());
                }
                other => panic!("{p}: {other:?}"),
            }
        }
    }
    assert_eq!(
        FingerprintSpec {
            exclude: vec!["/a".into()],
            include: vec!["/b".into()],
            ..spec()
        }
        .validate(),
        Err(FingerprintSpecError::IncludeAndExclude)
    );
    for s in [
        FingerprintSpec {
            body: false,
            exclude: vec!["/a".into()],
            ..spec()
        },
        FingerprintSpec {
            body: false,
            include: vec!["/a".into()],
            ..spec()
        },
    ] {
        assert_eq!(s.validate(), Err(FingerprintSpecError::PointersWithoutBody));
    }
    assert_eq!(
        FingerprintSpec {
            query: false,
            ignore_query: vec!["utm".into()],
            ..spec()
        }
        .validate(),
        Err(FingerprintSpecError::IgnoreQueryWithoutQuery)
    );
    // An unvalidated spec still fingerprints, with the body raw.
    let bad = FingerprintSpec {
        exclude: vec!["delivered_at".into()],
        ..spec()
    };
    assert_ne!(
        fp(&bad, "/p", r#"{"a":1,"delivered_at":1}"#),
        fp(&bad, "/p", r#"{"delivered_at":1,"a":1}"#)
    );
}

fn arb_method() -> impl Strategy<Value = Method> {
    prop_oneof![
        Just(Method::POST),
        Just(Method::PATCH),
        Just(Method::PUT),
        Just(Method::DELETE),
        "[A-Z]{1,8}".prop_map(|m| Method::from_bytes(m.as_bytes()).unwrap()),
    ]
}

fn arb_content_types() -> impl Strategy<Value = Vec<&'static str>> {
    prop::collection::vec(
        prop::sample::select(vec![
            "application/json",
            "application/json; charset=utf-8",
            "application/vnd.x+json",
            "text/plain",
            "application/octet-stream",
            "",
        ]),
        0..3,
    )
}

fn arb_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        "\\PC{0,32}".prop_map(String::into_bytes),
        (any::<i32>(), "[a-z]{0,6}", any::<bool>())
            .prop_map(|(n, s, b)| format!(r#"{{ "s": "{s}", "n": {n}, "b": {b} }}"#).into_bytes()),
        Just(br#"{"a":1,"a":2}"#.to_vec()),
    ]
}

proptest! {
    /// The default spec, whatever its route name, is `request_fingerprint`.
    #[test]
    fn default_spec_equals_request_fingerprint(
        method in arb_method(),
        path in "(/[a-zA-Z0-9._~%-]{0,6}){1,4}",
        query in prop::option::of("[a-zA-Z0-9=&%+._-]{0,16}"),
        content_types in arb_content_types(),
        body in arb_body(),
        route in "[a-z0-9._-]{0,12}",
    ) {
        let target = match &query {
            Some(q) => format!("{path}?{q}"),
            None => path.clone(),
        };
        let uri: Uri = target.parse().unwrap();
        let mut h = HeaderMap::new();
        for ct in &content_types {
            h.append("content-type", HeaderValue::from_static(ct));
        }
        let s = FingerprintSpec { route, ..FingerprintSpec::default() };
        prop_assert_eq!(
            request_fingerprint_with(&s, &method, &uri, &h, &body),
            request_fingerprint(&method, &uri, &h, &body)
        );
    }

    /// Ignoring a name that is not in the query only moves the request to
    /// the spec's own space: two queries compare the same way as without it.
    #[test]
    fn ignoring_an_absent_name_keeps_comparisons(
        a in prop::option::of("[a-z0-9=&]{0,12}"),
        b in prop::option::of("[a-z0-9=&]{0,12}"),
    ) {
        let s = FingerprintSpec { ignore_query: vec!["UTM".into()], ..FingerprintSpec::default() };
        let uri = |q: &Option<String>| -> Uri {
            match q { Some(q) => format!("/p?{q}"), None => "/p".into() }.parse().unwrap()
        };
        let h = HeaderMap::new();
        let plain = |q| request_fingerprint(&Method::POST, &uri(q), &h, b"");
        let with = |q| request_fingerprint_with(&s, &Method::POST, &uri(q), &h, b"");
        prop_assert_eq!(plain(&a) == plain(&b), with(&a) == with(&b));
    }
}

/// Any spec (valid or not), with random parts switched off and random
/// lists, over random requests.
fn arb_spec() -> impl Strategy<Value = FingerprintSpec> {
    let pointer = prop_oneof![
        "(/[a-z0-9~-]{0,3}){0,3}",
        Just(String::new()),
        "[a-z~/]{0,4}",
    ];
    (
        any::<[bool; 4]>(),
        prop::collection::vec("[a-z%+_]{0,4}", 0..3),
        prop::collection::vec(
            prop::sample::select(vec!["x-a", "x-b", "content-type"]),
            0..3,
        ),
        prop::collection::vec(pointer.clone(), 0..3),
        prop::collection::vec(pointer, 0..3),
        "[a-z]{0,4}",
    )
        .prop_map(
            |([method, path, query, body], iq, h, exclude, include, route)| FingerprintSpec {
                method,
                path,
                query,
                ignore_query: iq,
                headers: h.into_iter().map(HeaderName::from_static).collect(),
                body,
                exclude,
                include,
                route,
            },
        )
}

fn arb_json_body() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("null".to_owned()),
        Just("1".to_owned()),
        Just("1.5".to_owned()),
        Just("9007199254740993".to_owned()),
        Just(r#""s""#.to_owned()),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            prop::collection::vec(("[a-z0-9~/-]{0,2}", inner), 0..4).prop_map(|m| {
                let members: Vec<String> = m
                    .into_iter()
                    .map(|(k, v)| format!("{}:{v}", serde_json::to_string(&k).unwrap()))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    })
}

proptest! {
    /// No spec and no request make the fingerprint panic, and it is a
    /// function of its inputs.
    #[test]
    fn any_spec_fingerprints_without_panicking(
        spec in arb_spec(),
        query in prop::option::of("[a-z%+_=&]{0,12}"),
        body in prop_oneof![arb_json_body(), "\\PC{0,16}"],
        json in any::<bool>(),
        header_values in prop::collection::vec((prop::sample::select(vec!["x-a", "x-b"]), "[a-z]{0,3}"), 0..3),
    ) {
        let uri: Uri = match &query { Some(q) => format!("/p?{q}"), None => "/p".into() }.parse().unwrap();
        let mut h = HeaderMap::new();
        if json {
            h.insert("content-type", HeaderValue::from_static("application/json"));
        }
        for (n, v) in &header_values {
            h.append(*n, HeaderValue::from_str(v).unwrap());
        }
        let a = request_fingerprint_with(&spec, &Method::POST, &uri, &h, body.as_bytes());
        prop_assert_eq!(a, request_fingerprint_with(&spec, &Method::POST, &uri, &h, body.as_bytes()));
        if !spec.is_default() {
            prop_assert_ne!(a, request_fingerprint(&Method::POST, &uri, &h, body.as_bytes()));
        }
    }

    /// With `exclude`, a JSON body and its canonical form fingerprint the
    /// same (what is left is canonicalised as RFC 8785 says).
    #[test]
    fn exclude_keeps_canonicalisation(
        body in arb_json_body(),
        exclude in prop::collection::vec("(/[a-z0-9~-]{0,2}){1,3}".prop_filter("RFC 6901", |p| idem_http::body_key::validate_pointer(p).is_ok()), 1..3),
    ) {
        let s = FingerprintSpec { exclude, ..FingerprintSpec::default() };
        if let Some(canonical) = idem_http::fingerprint::canonical_json(body.as_bytes()) {
            let spaced = body.replace(',', " ,\n ").replace(':', " : ");
            let canonical = String::from_utf8(canonical).unwrap();
            prop_assert_eq!(fp(&s, "/p", &body), fp(&s, "/p", &canonical));
            prop_assert_eq!(fp(&s, "/p", &body), fp(&s, "/p", &spaced));
        }
    }
}
