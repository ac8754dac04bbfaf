//! A plain HTTP/1 server for the harness's fakes on loopback (the spot
//! notice's IMDS, the guest report sink): one task accepting until its
//! token is cancelled, one per connection, every request answered by the
//! fake's own function.

use std::future::Future;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `listener` in the background until `stop` is cancelled, each
/// request answered by `answer`. A connection that fails is dropped; the
/// others go on.
pub fn serve_http1<F, Fut>(listener: TcpListener, stop: CancellationToken, answer: F)
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((stream, _)) = accepted else { continue };
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let answered = answer(req);
                    async move { Ok::<_, std::convert::Infallible>(answered.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}
