//! Replays every file of `fuzz/corpus/<target>/` through its target's body,
//! so the corpus the fuzzer found is checked by `cargo test` without one.

use std::path::Path;

#[test]
fn every_corpus_file_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let mut replayed = 0;
    for (name, body) in idem_fuzz::TARGETS {
        let dir = root.join(name);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a corpus entry").path();
            let data = std::fs::read(&path).expect("a corpus file");
            body(&data);
            replayed += 1;
        }
    }
    println!("replayed {replayed} corpus files");
}

#[test]
fn hand_picked_inputs_pass() {
    for (_, body) in idem_fuzz::TARGETS {
        for input in [
            &b""[..],
            b"\"abc\";a=1",
            b"abc",
            br#"{"b":1.0,"a":[true,null,"x"]}"#,
            b"POST\0/orders?x=1\0application/json\0{\"a\":1}",
            b"1h 30m",
            b"10MiB",
            b"http://127.0.0.1:3000/api",
            b"redis://:pw@h:6379/2?idem_prefix=p",
            b"postgres://u:pw@h/db?idem_table=t",
            b"authorization\0Bearer a\0x-api-key\0k",
        ] {
            body(input);
        }
    }
}
