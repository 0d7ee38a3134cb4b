//! The TLS listener: a rustls acceptor whose certificate is reloaded when
//! its files change or on SIGHUP (a failed reload keeps the old one and
//! logs why), ALPN `h2` and `http/1.1`, and optional client-certificate
//! verification (`--tls-client-ca`).
