//! Rendering in a worker process ([`ChatTemplate::isolated`](super::ChatTemplate::isolated)):
//! the server's side of [`super::worker`].
//!
//! Two templates crash whatever process renders them, and minijinja offers no hook to stop them
//! (the module doc of [`super`]). So the server keeps its template's renders in other
//! processes: each render checks a worker out of a small pool (starting one if none waits),
//! sends it the request, and waits for its reply at most [`WORKER_TIMEOUT`]. A worker that ends
//! instead of answering, answers garbage or does not answer in time is killed, reaped and
//! dropped, and the render fails with [`TemplateError::Crashed`]; the next render starts a
//! fresh one. Invariants: a worker in the pool has compiled the template and answered every
//! request sent to it, so it waits for the next; at most [`MAX_IDLE_WORKERS`] wait; a worker is
//! never used by two renders at once.
//!
//! A worker that cannot start, or ends before it has compiled the template, fails the render
//! with [`TemplateError::WorkerStart`]: the template compiled in the server, so that is the
//! server's trouble, not the request's. Workers run in a process group of their own, so that
//! a Ctrl-C at the server's terminal, meant for the server (which shuts down gracefully), does
//! not end a render in flight.
//!
//! Cost: a render on a waiting worker adds the conversation and the prompt written as JSON
//! through two pipes, and a fresh worker a process start and a compile.

use std::io::{self, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::TemplateError;
use super::wire::{self, Handshake, Ready, Reply, Request};

/// How long a worker may take to answer a render (a fresh one: to start, compile and render)
/// before it is killed. Fuel bounds a render's real work to a few seconds, so this only ends a
/// worker that is stuck.
pub const WORKER_TIMEOUT: Duration = Duration::from_secs(30);
/// Workers kept waiting for the next renders; more, started for renders at the same time, are
/// ended when their render is done.
const MAX_IDLE_WORKERS: usize = 2;
/// The reader and writer threads only move frames between a pipe and a channel or a buffer.
const READER_STACK_BYTES: usize = 64 << 10;
/// How much of a dead worker's stderr is read, and how many characters of its last lines go
/// into the error.
const STDERR_READ_BYTES: u64 = 1 << 20;
const STDERR_TAIL_CHARS: usize = 400;

/// A template's workers: how to start one, and those waiting.
#[derive(Debug)]
pub(super) struct Isolation {
    program: PathBuf,
    args: Vec<String>,
    timeout: Duration,
    idle: Mutex<Vec<Worker>>,
}

impl Isolation {
    pub(super) fn new(program: PathBuf, args: Vec<String>, timeout: Duration) -> Self {
        Isolation {
            program,
            args,
            timeout,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Renders `request` in a worker: a waiting one, or one started with `handshake`.
    pub(super) fn render(
        &self,
        handshake: &Handshake<'_>,
        request: &Request<'_>,
    ) -> Result<String, TemplateError> {
        let frame = wire::encode(request).map_err(|e| TemplateError::Render {
            message: format!("the conversation cannot be sent to its render process: {e}"),
        })?;
        let deadline = Instant::now() + self.timeout;
        let mut worker = match self.take_idle() {
            Some(worker) => worker,
            None => self.start(handshake, deadline)?,
        };
        let reply = match worker.ask(&frame, deadline, self.timeout) {
            Ok(reply) => reply,
            Err(what) => {
                return Err(TemplateError::Crashed {
                    status: worker.end(&what),
                });
            }
        };
        match reply {
            // It answered: whatever the template did, the worker is ready for the next request.
            Reply::Prompt(prompt) => {
                self.put_back(worker);
                Ok(prompt)
            }
            Reply::Render(message) => {
                self.put_back(worker);
                Err(TemplateError::Render { message })
            }
            // Its render thread could not start within its address space: likely again in
            // this worker, so it is dropped (ended) and the next render starts a fresh one.
            Reply::Thread(message) => Err(TemplateError::Thread(io::Error::other(message))),
        }
    }

    /// A fresh worker that has compiled the template.
    fn start(&self, handshake: &Handshake<'_>, deadline: Instant) -> Result<Worker, TemplateError> {
        // A source within TEMPLATE_SOURCE_LIMIT always fits a frame.
        let frame = wire::encode(handshake).map_err(|e| TemplateError::Compile {
            path: None,
            message: e.to_string(),
        })?;
        let mut command = Command::new(&self.program);
        // A process group of its own: a Ctrl-C meant for the server does not end a render.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        let mut child = command
            .args(&self.args)
            // What a crash writes goes into the error: its message, without a backtrace.
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(TemplateError::Spawn)?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            unreachable!("stdin and stdout are piped");
        };
        let (send, replies) = mpsc::sync_channel(1);
        let reader = std::thread::Builder::new()
            .name("chat-template-reader".into())
            .stack_size(READER_STACK_BYTES)
            .spawn(move || read_replies(stdout, send));
        if let Err(e) = reader {
            let _ = child.kill();
            let _ = child.wait();
            return Err(TemplateError::Spawn(e));
        }
        let mut worker = Worker {
            child,
            stdin,
            replies,
        };
        // The template compiled in this process: a worker that does not compile it is broken.
        let status = match worker.ask(&frame, deadline, self.timeout) {
            Ok(Ready::Compiled) => return Ok(worker),
            Ok(Ready::Compile(message)) => format!("it could not compile the template: {message}"),
            Ok(Ready::Thread(message)) => format!("its render thread did not start: {message}"),
            Err(what) => worker.end(&what),
        };
        Err(TemplateError::WorkerStart { status })
    }

    /// A waiting worker, if one is still alive.
    fn take_idle(&self) -> Option<Worker> {
        loop {
            let mut worker = self.lock_idle().pop()?;
            // One that ended while it waited (killed from outside) is dropped for the next.
            if !worker.has_ended() {
                return Some(worker);
            }
        }
    }

    /// Keeps `worker` for the next render, or ends it if enough wait.
    fn put_back(&self, worker: Worker) {
        let surplus = {
            let mut idle = self.lock_idle();
            if idle.len() < MAX_IDLE_WORKERS {
                idle.push(worker);
                None
            } else {
                Some(worker)
            }
        };
        drop(surplus); // killed outside the lock
    }

    fn lock_idle(&self) -> std::sync::MutexGuard<'_, Vec<Worker>> {
        // A panic elsewhere cannot leave the list half changed: a push or a pop.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One worker process. Dropped: killed and reaped.
#[derive(Debug)]
struct Worker {
    child: Child,
    stdin: ChildStdin,
    /// Its stdout's frames, read by a thread of their own so that a wait can time out: a frame,
    /// then `Ok(None)` at the end of its output or an error.
    replies: Receiver<io::Result<Option<Vec<u8>>>>,
}

impl Worker {
    /// Writes `frame` and waits until `deadline` for the answer; what went wrong otherwise (for
    /// [`Worker::crashed`]).
    fn ask<T: DeserializeOwned>(
        &mut self,
        frame: &[u8],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<T, String> {
        let Worker {
            child,
            stdin,
            replies,
        } = self;
        let wait = deadline.saturating_duration_since(Instant::now());
        // The frame is written on a thread of its own, so that a worker that reads nothing
        // (a frame larger than the pipe holds) cannot hold the render past the deadline: it is
        // killed, its pipe breaks, and the write ends.
        std::thread::scope(|scope| {
            let writer = std::thread::Builder::new()
                .name("chat-template-writer".into())
                .stack_size(READER_STACK_BYTES)
                .spawn_scoped(scope, || wire::write_frame(stdin, frame))
                .map_err(|e| format!("no thread could write its request ({e})"))?;
            let reply = replies.recv_timeout(wait);
            if matches!(reply, Err(RecvTimeoutError::Timeout)) {
                let _ = child.kill();
            }
            let written = writer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            match (reply, written) {
                (Ok(Ok(Some(json))), _) => {
                    wire::decode(&json).map_err(|e| format!("it answered a malformed frame ({e})"))
                }
                (Err(RecvTimeoutError::Timeout), _) => Err(format!(
                    "it gave no answer within {timeout:?} and was killed"
                )),
                (_, Err(e)) => Err(format!("it took no request ({e})")),
                (Ok(Ok(None)) | Err(RecvTimeoutError::Disconnected), _) => Err("it ended".into()),
                (Ok(Err(e)), _) => Err(format!("it answered a malformed frame ({e})")),
            }
        })
    }

    /// Kills (if it has not ended by itself) and reaps the worker, and says how it ended: `what`
    /// went wrong, its exit status, and the last lines it wrote to stderr.
    fn end(mut self, what: &str) -> String {
        let _ = self.child.kill();
        let mut status = match self.child.wait() {
            Ok(exit) => format!("{what} ({exit})"),
            Err(e) => format!("{what} (its exit status is unknown: {e})"),
        };
        let said = self.stderr_tail();
        if !said.is_empty() {
            status = format!("{status}: {said}");
        }
        status
    }

    /// The last lines the worker wrote to stderr, joined with " / ": read once it has ended, when
    /// the pipe holds all there is.
    fn stderr_tail(&mut self) -> String {
        let Some(stderr) = self.child.stderr.take() else {
            return String::new();
        };
        let mut text = Vec::new();
        let _ = stderr.take(STDERR_READ_BYTES).read_to_end(&mut text);
        let text = String::from_utf8_lossy(&text);
        let lines: Vec<&str> = (text.lines().map(str::trim))
            // Not the hint to set RUST_BACKTRACE, which the worker runs without.
            .filter(|line| !line.is_empty() && !line.contains("RUST_BACKTRACE"))
            .collect();
        let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
        let cut = tail.chars().count().saturating_sub(STDERR_TAIL_CHARS);
        tail.chars().skip(cut).collect()
    }

    fn has_ended(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Moves each frame of a worker's stdout to `replies`, until the output ends or breaks (which
/// is sent too), or nobody listens.
fn read_replies(mut stdout: ChildStdout, replies: SyncSender<io::Result<Option<Vec<u8>>>>) {
    loop {
        let frame = wire::read_frame(&mut stdout);
        let last = !matches!(frame, Ok(Some(_)));
        if replies.send(frame).is_err() || last {
            return;
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    use crate::chat_template::{ChatMessage, ChatTemplate, TemplateError};

    /// `source` isolated in `program args`, which is not a worker: these are the ways a worker
    /// fails.
    fn isolated_in_with(
        source: &str,
        program: &str,
        args: &[&str],
        timeout: Duration,
    ) -> ChatTemplate {
        ChatTemplate::from_source(source, None, None)
            .unwrap()
            .isolated_with_timeout(
                PathBuf::from(program),
                args.iter().map(|a| a.to_string()).collect(),
                timeout,
            )
    }

    fn isolated_in(program: &str, args: &[&str], timeout: Duration) -> ChatTemplate {
        isolated_in_with("{{ messages[0].content }}", program, args, timeout)
    }

    fn render(template: &ChatTemplate) -> Result<String, TemplateError> {
        template.render(&[ChatMessage::new("user", "hi")], true)
    }

    /// `source` isolated in `sleep 60`, which reads nothing and answers nothing, with a 300 ms
    /// deadline: the render fails within seconds, the worker killed before it started; its
    /// status.
    fn killed_at_the_deadline(source: &str) -> String {
        let template = isolated_in_with(source, "sleep", &["60"], Duration::from_millis(300));
        let start = Instant::now();
        let err = render(&template).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        // It never answered the handshake: it did not start.
        let TemplateError::WorkerStart { status } = err else {
            panic!("{err:?}");
        };
        assert!(status.contains("no answer within 300ms"), "{status}");
        status
    }

    #[test]
    fn a_worker_that_never_answers_is_killed_at_the_timeout() {
        let status = killed_at_the_deadline("{{ messages[0].content }}");
        assert!(status.contains("SIGKILL"), "{status}");
    }

    /// A worker that reads nothing, sent a handshake larger than a pipe holds (a template of
    /// 200 KiB): the write would block for ever; the deadline kills the worker.
    #[test]
    fn a_worker_that_reads_nothing_is_killed_at_the_timeout() {
        let source = format!(
            "{{# {} #}}{{{{ messages[0].content }}}}",
            "x".repeat(200 << 10)
        );
        killed_at_the_deadline(&source);
    }

    #[test]
    fn a_worker_that_ends_or_answers_garbage_before_compiling_did_not_start() {
        let template = isolated_in(
            "sh",
            &["-c", "echo oops >&2; exit 3"],
            super::WORKER_TIMEOUT,
        );
        let err = render(&template).unwrap_err();
        assert!(
            matches!(&err, TemplateError::WorkerStart { status }
                if status.contains("exit status: 3") && status.ends_with(": oops")),
            "{err}"
        );
        assert!(
            err.to_string()
                .starts_with("the chat template's render process did not start: ")
        );
        // A length past the frame limit.
        let template = isolated_in(
            "sh",
            &["-c", "printf 'zzzz'; sleep 5"],
            super::WORKER_TIMEOUT,
        );
        let err = render(&template).unwrap_err();
        assert!(err.to_string().contains("malformed"), "{err}");
    }

    #[test]
    fn a_worker_that_cannot_start_is_the_servers_trouble() {
        let template = isolated_in("/nonexistent/kiln", &[], super::WORKER_TIMEOUT);
        let err = render(&template).unwrap_err();
        assert!(matches!(err, TemplateError::Spawn(_)), "{err:?}");
        assert!(
            err.to_string()
                .starts_with("could not start the chat template's render process")
        );
    }
}
