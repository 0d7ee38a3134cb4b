//! The connector for `https://` upstreams: system roots or `--upstream-ca`,
//! SNI and the name check from the URL's host, an optional client
//! certificate; and HTTP/2 to the upstream (`--upstream-http2`).
