//! The authenticated CONNECT proxy for the results service (spec/cache.md
//! §2.5 "Tunnel setup", "Inner-request host check", "Classification",
//! "Splice").
//!
//! **Listener.** One TCP listener per node (`--cache-proxy-listen`, by
//! default the Docker bridge's gateway), because a container cannot use a
//! Unix socket as an HTTPS proxy. The address is no authority: anything
//! that reaches it must still present `Proxy-Authorization: Basic
//! billet:<token>` with the token of an intercepting session, compared in
//! constant time, or gets 407.
//!
//! **A tunnel** goes only to [`RESULTS_HOST`]`:443` (another host: 403; not
//! an authority: 400). Inside it the node terminates TLS 1.3 with its
//! interception CA's leaf ([`InterceptionCa`]), reads the first request's
//! head (at most 64 KiB, within 10 s), refuses a request for another host
//! with a local 421 without dialling anyone, and classifies it:
//!
//! - a signed URL's path (`/_billet/actions-cache/`): answered here, always;
//! - exactly one of the three `CacheService` Twirp paths, `POST`, no query,
//!   `Content-Type: application/json`, `User-Agent: @actions/cache-…`, with
//!   a `Content-Length` body of at most 64 KiB: answered here when
//!   [`Archives::twirp`] does, else spliced;
//! - everything else: spliced to the upstream unchanged, the bytes read so
//!   far replayed first, then both directions copied until either side
//!   ends (so a guest that never half-closes does not pin the handler).
//!
//! A locally answered request gets `X-Billet-Actions-Cache: local` and the
//! tunnel closes after it; a spliced tunnel stays spliced.
//!
//! **A download is fetched outside the tunnel.** The signed download URL a
//! lookup answers is `http://<listener>/_billet/actions-cache/<id>?sig=`,
//! so `@actions/cache` (which sends plain `http://` requests through no
//! HTTPS proxy) fetches it straight from this listener: a `GET` or `HEAD`
//! of that path, not a CONNECT, is answered by
//! [`Archives::direct_download`], the URL's signature its only credential
//! (as a blob store's). The guest then neither decrypts nor the node
//! encrypts the archive's bytes. Uploads stay in the tunnel.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine as _;
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::RESULTS_HOST;
use super::archives::{Answer, Archives, BLOB_PREFIX, Twirp};
use super::ca::InterceptionCa;
use crate::cache::session::CacheToken;

/// The proxy's port when `--cache-proxy-listen` names none: the same after
/// a restart, so a running job's proxy URL stays good.
pub(crate) const DEFAULT_PORT: u16 = 7718;
/// Longest head of an inner request, terminator included.
pub(crate) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Longest Twirp body the node reads to decide.
pub(crate) const MAX_TWIRP_BODY_BYTES: usize = 64 * 1024;
/// How long a tunnel's TLS handshake and first request head may take.
pub(crate) const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Most TLS bytes a blob tunnel holds encrypted and unsent (rustls'
/// default is 64 KiB): a whole download frame, so each is encrypted and
/// written in one go.
pub(crate) const BLOB_TLS_BUFFER_BYTES: usize = 1 << 20;
/// The user a proxy credential names.
pub(crate) const PROXY_USER: &str = "billet";
/// Most connections the proxy holds open at once, tunnels included (each
/// may hold a second descriptor, its splice to the upstream): room for a
/// few concurrent transfers of every guest, without letting the guests
/// take the descriptors the plane's session, the journal and Docker need.
/// Past it the newcomer is kept and an idle connection of the peer holding
/// the most is dropped ([`crate::listen::ConnectionCap`], decision 127), as
/// the gRPC and metrics listeners do: a request, download or tunnel in
/// progress is busy and passed over while an idle one is open, so a flood
/// of idle connections (which needs no token) costs its sender alone.
pub(crate) const MAX_PROXY_CONNECTIONS: usize = 128;
/// Most connections one peer address holds open; past it the peer's own
/// oldest idle one goes. Guests on the host's network share the address
/// they reach the proxy from, and share this bound.
pub(crate) const MAX_PROXY_CONNECTIONS_PER_PEER: usize = 32;

/// Why the proxy cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The upstream's trust roots cannot be read.
    #[error("the results service's trust roots: {0}")]
    Roots(String),
    /// The listen address cannot be handed to guests.
    #[error(
        "--cache-proxy-listen {0} is an unspecified address; name the address guests reach, e.g. the Docker bridge's gateway 172.17.0.1:7718"
    )]
    Unspecified(SocketAddr),
}

/// Where spliced requests go: GitHub's results host on 443 by default;
/// a test's fake with an extra trust root.
#[derive(Clone)]
pub struct Upstream {
    addr: String,
    tls: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// `addr` (`HOST:PORT`; `None`: [`RESULTS_HOST`]`:443`), trusting the
    /// system's roots and `extra_ca_pem`'s certificates. Dialled with
    /// [`RESULTS_HOST`] as the server name and ALPN `http/1.1` only.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Roots`] when no root can be read.
    pub fn new(addr: Option<String>, extra_ca_pem: Option<&[u8]>) -> Result<Self, ProxyError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        if let Some(pem) = extra_ca_pem {
            let mut reader = pem;
            for cert in rustls_pemfile::certs(&mut reader) {
                let cert = cert.map_err(|e| ProxyError::Roots(e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| ProxyError::Roots(e.to_string()))?;
            }
        }
        if roots.is_empty() {
            return Err(ProxyError::Roots(
                "no trust root: install the system's CA certificates (ca-certificates)".into(),
            ));
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ProxyError::Roots(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            addr: addr.unwrap_or_else(|| format!("{RESULTS_HOST}:443")),
            tls: Arc::new(tls),
        })
    }

    async fn dial(
        &self,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let tcp = tokio::time::timeout(
            FIRST_REQUEST_TIMEOUT,
            tokio::net::TcpStream::connect(&self.addr),
        )
        .await
        .map_err(|_| std::io::Error::other("the results service did not answer in 10 s"))??;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(RESULTS_HOST)
            .expect("the results host is a DNS name");
        tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(name, tcp)
            .await
    }
}

/// A guest's proxy URL, `http://billet:<token>@<addr>`: a credential, so
/// its `Debug` is redacted and it reaches the guest only in the
/// environment the provider keeps apart from the plain one.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl(String);

impl ProxyUrl {
    /// The URL's text, for the guest's environment and nothing else.
    #[must_use]
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProxyUrl(<redacted>)")
    }
}

/// The node's Actions cache proxy: the archives it answers from, the CA
/// it intercepts with, the upstream it splices to, the address guests
/// dial.
pub struct ActionsProxy {
    archives: Arc<Archives>,
    ca: Arc<InterceptionCa>,
    upstream: Upstream,
    addr: SocketAddr,
    tls: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for ActionsProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActionsProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl ActionsProxy {
    /// A proxy guests reach at `addr` (the bound listener's address).
    ///
    /// # Errors
    ///
    /// [`ProxyError::Unspecified`] for `0.0.0.0` or `::`.
    pub fn new(
        archives: Arc<Archives>,
        ca: Arc<InterceptionCa>,
        upstream: Upstream,
        addr: SocketAddr,
    ) -> Result<Arc<Self>, ProxyError> {
        if addr.ip().is_unspecified() {
            return Err(ProxyError::Unspecified(addr));
        }
        let tls = tokio_rustls::TlsAcceptor::from(ca.server_config());
        archives.serve_downloads_at(addr);
        Ok(Arc::new(Self {
            archives,
            ca,
            upstream,
            addr,
            tls,
        }))
    }

    /// The archives and sessions.
    #[must_use]
    pub fn archives(&self) -> &Arc<Archives> {
        &self.archives
    }

    /// The CA a guest trusts, PEM.
    #[must_use]
    pub(crate) fn ca_pem(&self) -> &str {
        self.ca.ca_pem()
    }

    /// The proxy URL of the session whose token is `token`.
    #[must_use]
    pub(crate) fn guest_url(&self, token: &CacheToken) -> ProxyUrl {
        ProxyUrl(format!(
            "http://{PROXY_USER}:{}@{}",
            token.expose(),
            self.addr
        ))
    }

    /// Serves `listener` until `stop`; each connection in a task of its
    /// own, cut when `stop` fires, at most [`MAX_PROXY_CONNECTIONS`] open
    /// (a tunnel counts until it ends); a failed accept backs off and is
    /// logged at a bounded rate ([`crate::listen::AcceptErrors`]).
    pub async fn serve(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        stop: CancellationToken,
    ) {
        use crate::listen::{AcceptErrors, AtCap, ConnectionCap};
        let cap = ConnectionCap::new("actions_proxy", MAX_PROXY_CONNECTIONS, AtCap::DropOldest)
            .per_peer(MAX_PROXY_CONNECTIONS_PER_PEER);
        let mut errors = AcceptErrors::new("actions_proxy");
        loop {
            let (stream, peer) = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        errors.back_off(&e).await;
                        continue;
                    }
                },
            };
            errors.accepted();
            // Shared with the tunnel the connection may become, which
            // outlives the HTTP connection: the place is held until both end.
            let Some(admitted) = cap.admit_from(peer.ip()).map(Arc::new) else {
                continue;
            };
            let dropped = admitted.clone();
            let _ = stream.set_nodelay(true);
            let proxy = self.clone();
            let stop = stop.clone();
            let cut = stop.clone();
            // Owned by `stop`: the connection ends with the proxy (a direct
            // download in progress included; a tunnel watches `stop` too).
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let proxy = proxy.clone();
                    let stop = stop.clone();
                    let admitted = admitted.clone();
                    async move {
                        // Busy while answered, and a download while its
                        // body is sent: an idle connection goes first.
                        let busy = admitted.busy();
                        if proxy.is_direct_download(&req) {
                            let response = proxy.archives.direct_download(req).await;
                            return Ok::<_, Infallible>(response.map(|body| {
                                body.map_frame(move |frame| {
                                    let _ = &busy;
                                    frame
                                })
                                .boxed()
                            }));
                        }
                        Ok(proxy
                            .connect(req, stop, admitted)
                            .map(|b| b.map_err(|never| match never {}).boxed()))
                    }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .max_buf_size(MAX_HEAD_BYTES)
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(FIRST_REQUEST_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .with_upgrades();
                tokio::select! {
                    () = cut.cancelled() => {}
                    () = dropped.dropped() => {}
                    _ = connection => {}
                }
            });
        }
    }

    /// A request for a download's signed URL straight to the listener
    /// (origin form, or absolute form naming this listener), not a CONNECT.
    fn is_direct_download(&self, req: &Request<hyper::body::Incoming>) -> bool {
        req.method() != Method::CONNECT
            && req.uri().path().starts_with(BLOB_PREFIX)
            && req
                .uri()
                .authority()
                .is_none_or(|a| a.as_str() == self.addr.to_string())
    }

    fn connect(
        self: &Arc<Self>,
        req: Request<hyper::body::Incoming>,
        stop: CancellationToken,
        admitted: Arc<crate::listen::Admitted>,
    ) -> Response<Empty<Bytes>> {
        if req.method() != Method::CONNECT {
            return status(StatusCode::METHOD_NOT_ALLOWED);
        }
        let Some(session) = self.authenticate(&req) else {
            let mut r = status(StatusCode::PROXY_AUTHENTICATION_REQUIRED);
            r.headers_mut().insert(
                hyper::header::PROXY_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Basic realm=\"billet\""),
            );
            return r;
        };
        match req.uri().authority() {
            Some(a) if a.port_u16().is_some() && req.uri().path_and_query().is_none() => {
                if !a.host().eq_ignore_ascii_case(RESULTS_HOST) || a.port_u16() != Some(443) {
                    return status(StatusCode::FORBIDDEN);
                }
            }
            _ => return status(StatusCode::BAD_REQUEST),
        }
        let proxy = self.clone();
        tokio::spawn(async move {
            // A tunnel is busy for its life; dropped only when its peer
            // holds nothing idle to give up.
            let _busy = admitted.busy();
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => u,
                Err(e) => {
                    debug!(error = %e, "a CONNECT was not upgraded");
                    return;
                }
            };
            tokio::select! {
                () = stop.cancelled() => {}
                () = admitted.dropped() => {}
                () = proxy.tunnel(hyper_util::rt::TokioIo::new(upgraded), &session) => {}
            }
        });
        status(StatusCode::OK)
    }

    fn authenticate(
        &self,
        req: &Request<hyper::body::Incoming>,
    ) -> Option<Arc<super::archives::ActionsSession>> {
        let value = req
            .headers()
            .get(hyper::header::PROXY_AUTHORIZATION)?
            .to_str()
            .ok()?;
        let (scheme, credentials) = value.trim().split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("basic") {
            return None;
        }
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(credentials.trim())
            .ok()?;
        let (user, token) = decoded.split_at(decoded.iter().position(|b| *b == b':')?);
        let token = &token[1..];
        if user != PROXY_USER.as_bytes() || token.is_empty() {
            return None;
        }
        self.archives.authenticate(token)
    }

    /// One tunnel: TLS, the first request's head, then local or spliced.
    async fn tunnel<S>(&self, stream: S, session: &super::archives::ActionsSession)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let first = tokio::time::timeout(FIRST_REQUEST_TIMEOUT, async {
            let mut tls = self.tls.accept(stream).await.ok()?;
            let head = read_head(&mut tls).await;
            Some((tls, head))
        })
        .await;
        let Ok(Some((mut tls, head))) = first else {
            return;
        };
        let (mut buf, head_len) = match head {
            Head::Complete(buf, len) => (buf, len),
            Head::TooLong => {
                return respond(&mut tls, 431, "the request's headers exceed 64 KiB").await;
            }
            Head::Closed => return,
        };
        let mut headers = [httparse::EMPTY_HEADER; 256];
        let mut parsed = httparse::Request::new(&mut headers);
        if !matches!(
            parsed.parse(&buf[..head_len]),
            Ok(httparse::Status::Complete(_))
        ) {
            return respond(&mut tls, 400, "the request is not HTTP/1.1").await;
        }
        let method = parsed.method.unwrap_or_default().to_owned();
        let target = parsed.path.unwrap_or_default().to_owned();
        let header = |name: &str| {
            parsed
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).into_owned())
        };
        if !targets_results_host(&target, header("host").as_deref()) {
            return respond(
                &mut tls,
                421,
                "this tunnel reaches the results service only",
            )
            .await;
        }
        if target.starts_with(BLOB_PREFIX) {
            // A download's frame is encrypted and handed to the socket at
            // once, not in rustls' default 64 KiB portions.
            tls.get_mut()
                .1
                .set_buffer_limit(Some(BLOB_TLS_BUFFER_BYTES));
            let io = hyper_util::rt::TokioIo::new(Rewind {
                prefix: Bytes::from(buf),
                inner: tls,
            });
            let archives = self.archives.clone();
            let service = hyper::service::service_fn(move |req| {
                let archives = archives.clone();
                async move { Ok::<_, Infallible>(archives.blob(session, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .max_buf_size(MAX_HEAD_BYTES + 1024)
                .serve_connection(io, service)
                .await;
            return;
        }
        let twirp = Twirp::of_path(&target).filter(|_| {
            method == "POST"
                && header("content-type").is_some_and(|c| {
                    c.split(';')
                        .next()
                        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
                })
                && header("user-agent").is_some_and(|u| {
                    u.strip_prefix("@actions/cache-")
                        .is_some_and(|rest| !rest.is_empty())
                })
        });
        let length = header("content-length").and_then(|l| l.trim().parse::<usize>().ok());
        if let (Some(twirp), Some(length)) = (twirp, length)
            && header("transfer-encoding").is_none()
        {
            if length > MAX_TWIRP_BODY_BYTES {
                return respond(&mut tls, 413, "a cache request's body is at most 64 KiB").await;
            }
            while buf.len() < head_len + length {
                let mut chunk = [0u8; 8192];
                match tls.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let body = &buf[head_len..head_len + length];
            match self.archives.twirp(session, twirp, body).await {
                Answer::Local(json) => {
                    return respond_json(&mut tls, &json).await;
                }
                Answer::Unavailable(message) => return respond(&mut tls, 502, message).await,
                Answer::Passthrough => {}
            }
        }
        self.splice(tls, &buf).await;
    }

    /// Replays `sent` to the upstream, then copies both ways until either
    /// side ends, and closes both.
    async fn splice<S>(&self, mut guest: S, sent: &[u8])
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut upstream = match self.upstream.dial().await {
            Ok(u) => u,
            Err(e) => {
                warn!(upstream = %self.upstream.addr, error = %e, "cannot reach the results service");
                return respond(&mut guest, 502, "the results service is unreachable").await;
            }
        };
        // Flushed: a TLS stream may hold what it was given until flushed,
        // and the copies below write (and so flush) only what comes next.
        if upstream.write_all(sent).await.is_err() || upstream.flush().await.is_err() {
            return;
        }
        let (mut gr, mut gw) = tokio::io::split(guest);
        let (mut ur, mut uw) = tokio::io::split(upstream);
        tokio::select! {
            _ = tokio::io::copy(&mut gr, &mut uw) => {}
            _ = tokio::io::copy(&mut ur, &mut gw) => {
                let _ = gw.shutdown().await;
            }
        }
    }
}

/// The inner request is origin-form and its `Host` is the results host
/// (any case, `:443` allowed).
#[must_use]
pub(crate) fn targets_results_host(target: &str, host: Option<&str>) -> bool {
    if !target.starts_with('/') || target.starts_with("//") {
        return false;
    }
    let Some(host) = host.map(str::trim) else {
        return false;
    };
    let name = host.strip_suffix(":443").unwrap_or(host);
    name.eq_ignore_ascii_case(RESULTS_HOST)
}

fn status(code: StatusCode) -> Response<Empty<Bytes>> {
    let mut r = Response::new(Empty::new());
    *r.status_mut() = code;
    r
}

enum Head {
    /// The bytes read (the head and maybe some body) and the head's length.
    Complete(Vec<u8>, usize),
    TooLong,
    Closed,
}

async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Head {
    let mut buf = Vec::with_capacity(8192);
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            if end + 4 > MAX_HEAD_BYTES {
                return Head::TooLong;
            }
            return Head::Complete(buf, end + 4);
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Head::TooLong;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return Head::Closed,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn reason(code: u16) -> &'static str {
    StatusCode::from_u16(code)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("")
}

async fn write_response<S: AsyncWrite + Unpin>(s: &mut S, code: u16, kind: &str, body: &[u8]) {
    let head = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nX-Billet-Actions-Cache: local\r\nConnection: close\r\n\r\n",
        reason(code),
        body.len()
    );
    let _ = s.write_all(head.as_bytes()).await;
    let _ = s.write_all(body).await;
    let _ = s.shutdown().await;
}

async fn respond<S: AsyncWrite + Unpin>(s: &mut S, code: u16, message: &str) {
    write_response(s, code, "text/plain; charset=utf-8", message.as_bytes()).await;
}

async fn respond_json<S: AsyncWrite + Unpin>(s: &mut S, json: &serde_json::Value) {
    let body = serde_json::to_vec(json).expect("answers serialise");
    write_response(s, 200, "application/json", &body).await;
}

/// A stream that yields `prefix` before its own bytes: the head read to
/// classify a request, handed back to the HTTP server that answers it.
struct Rewind<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let part = self.prefix.split_to(n);
            buf.put_slice(&part);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    // Forwarded, not left to the defaults: hyper copies every body frame
    // into a buffer of its own when its IO says it cannot take a vector.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_rewound_stream_takes_vectored_writes_when_its_inner_stream_does() {
        // hyper flattens (copies) every body frame into its own buffer for
        // an IO that is not vectored.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (mut peer, _) = accepted.unwrap();
        let mut rewind = Rewind {
            prefix: Bytes::from_static(b"head"),
            inner: client.unwrap(),
        };
        assert!(rewind.inner.is_write_vectored());
        assert!(rewind.is_write_vectored());
        let bufs = [
            std::io::IoSlice::new(b"one "),
            std::io::IoSlice::new(b"two"),
        ];
        let n = rewind.write_vectored(&bufs).await.unwrap();
        assert_eq!(n, 7, "both slices in one write");
        rewind.shutdown().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"one two");
        peer.write_all(b" and more").await.unwrap();
        drop(peer);
        let mut read = Vec::new();
        rewind.read_to_end(&mut read).await.unwrap();
        assert_eq!(read, b"head and more", "the prefix is read first");
    }
}
