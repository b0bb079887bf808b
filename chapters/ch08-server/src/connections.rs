//! The server's connections: how many may be open, and how long each may sit idle or take to
//! send a request, so that slow or silent clients cannot hold the server's sockets.
//!
//! ```text
//! accept ─ a slot free? ── no ─▶ 503, its sending side closed at once; what the client sent
//!            │                   read and dropped (≤ 100 ms, ≤ 64 KiB), then the socket closed
//!            │ yes
//!            ▼
//!  one task per connection: hyper's HTTP/1 over the socket, axum's router per request
//!    header-read timeout   from "waiting for a request" to its last header line
//!    keep-alive timeout    no request in progress and no byte received for this long
//!    send timeout          a response the client does not take: its socket's buffer full
//!                          for this long (the request is aborted with the connection)
//!    shutdown              finish the request in progress, then close
//! ```
//! The body-read timeout is the handlers' (they read the body after checking the key).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::error::ApiError;

/// How many connections, and how long they may take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnectionLimits {
    /// Most connections open at once; one more is answered 503 and closed.
    pub max_connections: usize,
    /// From the moment a connection waits for a request (it opened, or its previous response
    /// was sent) until that request's headers are all in.
    pub header_read_timeout: Duration,
    /// A connection with no request in progress that receives nothing for this long is closed.
    pub keep_alive_timeout: Duration,
    /// A connection whose client takes none of the response for this long (every write waits
    /// on a full socket buffer) is closed, and its request aborted: a client that stops
    /// reading a stream cannot hold its slot, nor have the server generate and buffer the
    /// rest of its tokens.
    pub send_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 512,
            header_read_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection over the limit is read for at most this long and this many bytes before it is
/// closed, and at most this many at once (see [`turn_away`]).
const DRAIN_TIME: Duration = Duration::from_millis(100);
const DRAIN_BYTES: usize = 64 * 1024;
const MAX_DRAINING: usize = 64;

/// What a connection over the limit is sent before it is closed.
fn busy_response() -> Vec<u8> {
    let body = ApiError::unavailable("too many open connections: retry shortly").to_json();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

// ANCHOR: serve
/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, lets every
/// connection finish the request it is serving, and returns when all are closed. Each
/// request carries its client's address as [`ConnectInfo<SocketAddr>`].
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    // More permits than a semaphore holds (2^61 − 1) is no limit at all: clamped, not refused.
    let slots = Arc::new(Semaphore::new(
        limits.max_connections.clamp(1, Semaphore::MAX_PERMITS),
    ));
    let busy = busy_response();
    let draining = Arc::new(Semaphore::new(MAX_DRAINING));
    let (closing, closed) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors, or a connection reset before it was accepted:
                // wait a moment rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            () = &mut shutdown => break,
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            // Best effort, never waiting: a full socket buffer just gets the close.
            let _ = stream.try_write(&busy);
            // Past MAX_DRAINING, closed at once (the client may then be reset).
            if let Ok(permit) = Arc::clone(&draining).try_acquire_owned() {
                connections.spawn(turn_away(stream, permit));
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(
            stream,
            peer,
            router.clone(),
            limits,
            closed.clone(),
            slot,
        ));
    }
    drop(listener);
    let _ = closing.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}
// ANCHOR_END: serve

/// Closes a connection over the limit that has been sent the 503: its sending side at once (the
/// client reads the answer, then its end), then the socket, once what the client sent has been
/// read and dropped, for at most [`DRAIN_TIME`] and [`DRAIN_BYTES`]. A socket closed with bytes
/// unread, or that bytes reach afterwards, is reset, and a client still writing its request
/// then gets ECONNRESET instead of the 503. It holds no slot, and ends by itself.
async fn turn_away(mut stream: TcpStream, _draining: OwnedSemaphorePermit) {
    let _ = std::future::poll_fn(|cx| Pin::new(&mut stream).poll_shutdown(cx)).await;
    let drain = async {
        let mut buf = [0u8; 4096];
        let mut read = 0;
        while read < DRAIN_BYTES && stream.readable().await.is_ok() {
            match stream.try_read(&mut buf) {
                Ok(0) => break,
                Ok(n) => read += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => break,
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
}

/// One connection, until the client closes it, a timeout closes it, or shutdown.
async fn connection(
    stream: TcpStream,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    mut closing: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        stream,
        activity: Arc::clone(&activity),
    });
    let requests = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |mut request: hyper::Request<_>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        let busy = requests.begin();
        let router = router.clone();
        async move {
            let response = router.oneshot(request.map(Body::new)).await?;
            // The request is in progress until its response's body is sent (or dropped).
            Ok::<_, Infallible>(response.map(|body| hold_until_sent(body, busy)))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let idle = activity.idle(limits.keep_alive_timeout);
    tokio::pin!(idle);
    let stalled = activity.stalled(limits.send_timeout);
    tokio::pin!(stalled);
    let shutdown = async move {
        let _ = closing.wait_for(|&closing| closing).await;
    };
    tokio::select! {
        _ = conn.as_mut() => {}
        () = &mut idle => {} // dropping the connection closes the socket
        () = &mut stalled => {}
        () = shutdown => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// A connection's requests in progress and the last time it received a byte.
struct Activity {
    opened: Instant,
    /// Nanoseconds from `opened` to the last byte received or the last response finished.
    last: AtomicU64,
    busy: AtomicUsize,
    /// Signalled when a request finishes.
    done: Notify,
    /// 1 + nanoseconds from `opened` to the first write that found the socket's buffer full,
    /// since the last write that went through; 0 while writes go through.
    blocked: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last: AtomicU64::new(0),
            busy: AtomicUsize::new(0),
            done: Notify::new(),
            blocked: AtomicU64::new(0),
        }
    }

    /// Notes how a write went: `Pending` (the socket's buffer is full) starts the send clock
    /// unless it runs already; anything else stops it.
    fn wrote<T>(&self, poll: &Poll<T>) {
        if poll.is_pending() {
            let nanos = u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let _ = self.blocked.compare_exchange(
                0,
                nanos.saturating_add(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        } else {
            self.blocked.store(0, Ordering::Relaxed);
        }
    }

    /// Resolves once writes have waited on a full socket buffer for `timeout` without one
    /// going through.
    async fn stalled(&self, timeout: Duration) {
        let period = (timeout / 4).max(Duration::from_millis(10));
        loop {
            tokio::time::sleep(period).await;
            let blocked = self.blocked.load(Ordering::Relaxed);
            if blocked == 0 {
                continue;
            }
            let since = self.opened + Duration::from_nanos(blocked - 1);
            if since.elapsed() >= timeout {
                return;
            }
        }
    }

    fn touch(&self) {
        let nanos = u64::try_from(self.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last.fetch_max(nanos, Ordering::Relaxed);
    }

    fn begin(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(Arc::clone(self))
    }

    /// Resolves once the connection has had no request in progress and received nothing for
    /// `timeout`.
    async fn idle(&self, timeout: Duration) {
        loop {
            if self.busy.load(Ordering::SeqCst) > 0 {
                self.done.notified().await;
                continue;
            }
            let last = self.opened + Duration::from_nanos(self.last.load(Ordering::Relaxed));
            let deadline = last + timeout;
            if Instant::now() >= deadline {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(deadline.into()) => {}
                () = self.done.notified() => {}
            }
        }
    }
}

/// A request in progress; dropping it ends it (and restarts the keep-alive clock).
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
        self.0.done.notify_one();
    }
}

/// A response body that holds `_busy` until it is sent or dropped.
struct Guarded<G> {
    body: Body,
    _busy: G,
}

impl<G: Unpin> http_body::Body for Guarded<G> {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// `body`, holding `guard` until the body is sent or dropped.
pub fn hold_until_sent<G: Send + Unpin + 'static>(body: Body, guard: G) -> Body {
    Body::new(Guarded { body, _busy: guard })
}

/// The socket, noting every byte received.
struct Watched {
    stream: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        poll
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.activity.wrote(&poll);
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.stream).poll_flush(cx);
        self.activity.wrote(&poll);
        poll
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.activity.wrote(&poll);
        poll
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
