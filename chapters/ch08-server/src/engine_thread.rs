//! The engine on its own thread: the only place that touches chapter 4's [`Engine`]. It runs
//! chapter 4's one engine loop, [`drive`], with the HTTP side as its [`EngineClient`]:
//!
//! ```text
//! poll:     idle?  block until a command comes        busy?  take the commands already queued
//!           Add    → engine.add_request, remember where its tokens go
//!           Abort  → engine.abort (its blocks are free before the next step)
//!           Snapshot → the dashboard's view of the engine, between two steps
//!           every request whose receiver is gone (client disconnected) → abort
//! on_step:  each request's new tokens to its channel; finished ones forgotten
//!           publish the gauges to the metrics
//! ```
//! HTTP handlers run on tokio; the step loop is synchronous and CPU-bound (it uses the rayon
//! pool), so it gets an OS thread and talks to handlers through channels only.

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;

use ch01::Llama;
use ch04::{
    CacheConfig, Engine, EngineClient, EngineConfig, EngineError, FinishReason, LogitsProcessor,
    Request, RequestId, RequestOutput, TokenLogprobs, drive,
};
use ch07::AttentionKind;
use tokio::sync::{mpsc, oneshot};

use crate::dashboard::{EngineSnapshot, History};
use crate::metrics::{EngineGauges, Metrics};
use crate::server::{ExecutorFactory, ServedWeights, SpeculatorFactory};

// ANCHOR: event
/// What the engine sends a request's handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New tokens of choice `choice` (with their logprobs when asked), and whether it ended.
    Tokens {
        choice: usize,
        tokens: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        finished: Option<FinishReason>,
    },
    /// The engine failed (a bug, or a model error): the request is over.
    Failed { choice: usize, message: String },
}
// ANCHOR_END: event

enum Command {
    /// Every choice of one HTTP request, added in one poll (choice `i` is `requests[i]`).
    Add {
        requests: Vec<Request>,
        processors: Vec<Option<Box<dyn LogitsProcessor>>>,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<Result<Vec<RequestId>, EngineError>>,
    },
    Abort(RequestId),
    AbortAll,
    Stop,
    /// The dashboard's view of the engine, taken between two steps.
    Snapshot(oneshot::Sender<EngineSnapshot>),
}

/// The handlers' side: cheap to clone, one per handler.
#[derive(Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    /// Cleared when the engine thread's loop ends, however it ends (a panic included).
    alive: Arc<AtomicBool>,
}

/// Clears `alive` when dropped: at the end of the engine thread, or while it unwinds.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Why a request could not be handed to the engine.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine has stopped")]
    Stopped,
    #[error(transparent)]
    Rejected(#[from] EngineError),
}

impl EngineHandle {
    // ANCHOR: submit
    /// Queues `requests` as choices `0..requests.len()` (`processors[i]`, if any, rewrites
    /// request `i`'s logits), all in the same engine poll (so all
    /// run from the same step, and a client that disconnects stops all of them at once); their
    /// tokens arrive on `events`. If one is refused none is queued. Every one is aborted
    /// as soon as `events`' receiver is dropped.
    pub async fn submit(
        &self,
        requests: Vec<Request>,
        processors: Vec<Option<Box<dyn LogitsProcessor>>>,
        events: mpsc::UnboundedSender<Event>,
    ) -> Result<Vec<RequestId>, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Add {
                requests,
                processors,
                events,
                reply,
            })
            .map_err(|_| SubmitError::Stopped)?;
        Ok(answer.await.map_err(|_| SubmitError::Stopped)??)
    }
    // ANCHOR_END: submit

    /// Whether the engine thread is still running its loop (`/health` asks).
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Ends the engine loop (what [`EngineThread::stop`] does, without joining): requests in
    /// flight end with `abort`, later ones are refused, and [`EngineHandle::is_alive`] turns
    /// false.
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Stop);
    }

    /// Aborts a request (a no-op if it already finished).
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// Aborts every request in flight (the end of a shutdown's grace period).
    pub fn abort_all(&self) {
        let _ = self.commands.send(Command::AbortAll);
    }

    /// The engine as the dashboard shows it, taken by the engine thread before its next step
    /// (at once when it is idle).
    pub async fn snapshot(&self) -> Result<EngineSnapshot, SubmitError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Snapshot(reply))
            .map_err(|_| SubmitError::Stopped)?;
        answer.await.map_err(|_| SubmitError::Stopped)
    }
}

/// The engine thread; [`EngineThread::stop`] ends it.
pub struct EngineThread {
    handle: EngineHandle,
    thread: Option<JoinHandle<()>>,
    /// [`ch04::Scheduler::max_request_tokens`] of the engine it runs.
    pub max_request_tokens: usize,
}

impl EngineThread {
    /// Starts the engine over `model`, with a CPU executor whose KV memory is `cache`, on a new
    /// thread. `install` runs the loop inside a thread pool of the caller's choosing (the binary
    /// passes its rayon pool's `install`, so the step's parallel loops run there); pass
    /// `|f| f()` for none.
    pub fn spawn(
        model: Arc<Llama>,
        cache: CacheConfig,
        config: EngineConfig,
        attention: AttentionKind,
        metrics: Arc<Metrics>,
        install: impl FnOnce(Box<dyn FnOnce() + Send>) + Send + 'static,
    ) -> Result<Self, EngineError> {
        Self::spawn_with(
            ServedWeights::Host(model),
            cache,
            config,
            attention,
            None,
            None,
            metrics,
            install,
        )
    }

    /// [`EngineThread::spawn`] over `weights`, with the speculator `speculator` builds
    /// (chapter 6) and the executor `executor` builds (chapter 8's ranks, chapter 7's GPU).
    /// Weights not in host memory need an executor factory; the speculator factory is then
    /// handed no model.
    #[allow(clippy::too_many_arguments)]
    pub fn spawn_with(
        weights: ServedWeights,
        cache: CacheConfig,
        config: EngineConfig,
        attention: AttentionKind,
        speculator: Option<SpeculatorFactory>,
        executor: Option<ExecutorFactory>,
        metrics: Arc<Metrics>,
        install: impl FnOnce(Box<dyn FnOnce() + Send>) + Send + 'static,
    ) -> Result<Self, EngineError> {
        let (commands, receiver) = std_mpsc::channel();
        let (started, start) = std_mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let guard = AliveGuard(Arc::clone(&alive));
        let thread = std::thread::Builder::new()
            .name("kiln-engine".into())
            .spawn(move || {
                let _alive = guard;
                install(Box::new(move || {
                    let factories = (speculator.as_ref(), executor.as_ref());
                    match start_engine(&weights, &cache, config, attention, factories) {
                        Ok(engine) => {
                            let _ = started.send(Ok(engine.scheduler().max_request_tokens()));
                            run(engine, receiver, &metrics);
                        }
                        Err(error) => {
                            let _ = started.send(Err(error));
                        }
                    }
                }))
            })
            .map_err(|e| EngineError::Config(format!("could not start the engine thread: {e}")))?;
        // The engine checks its configuration as it starts: report that to the caller.
        let max_request_tokens = match start.recv() {
            Ok(Ok(tokens)) => tokens,
            Ok(Err(error)) => return Err(error),
            Err(_) => return Err(EngineError::Config("the engine thread panicked".into())),
        };
        Ok(EngineThread {
            handle: EngineHandle { commands, alive },
            thread: Some(thread),
            max_request_tokens,
        })
    }

    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Aborts whatever is left, ends the loop and joins the thread.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.handle.commands.send(Command::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where one request's tokens go.
struct Route {
    choice: usize,
    events: mpsc::UnboundedSender<Event>,
}

/// The engine over the executor `executor` builds, else a CPU executor over the host weights,
/// with the KV memory `cache` (backed at start-up: see [`ch07::populated_cpu_executor`]) and the
/// `attention` backend.
fn start_engine<'m>(
    weights: &'m ServedWeights,
    cache: &CacheConfig,
    config: EngineConfig,
    attention: AttentionKind,
    (speculator, executor): (Option<&SpeculatorFactory>, Option<&ExecutorFactory>),
) -> Result<Engine<'m>, EngineError> {
    let not_on_host = |what: &str| {
        EngineError::Config(format!(
            "{what} needs the weights in host memory; they were left to an executor factory"
        ))
    };
    let executor = match (executor, weights) {
        (Some(factory), _) => (factory.0)(weights.config(), cache).map_err(EngineError::Config)?,
        (None, ServedWeights::Host(model)) => {
            ch07::populated_cpu_executor(model, cache, attention)?
        }
        (None, ServedWeights::Elsewhere(_)) => return Err(not_on_host("the CPU executor")),
    };
    let engine = Engine::boxed(executor, config)?;
    Ok(match speculator {
        Some(factory) => {
            engine.with_speculator((factory.0)(weights.host()).map_err(EngineError::Config)?)
        }
        None => engine,
    })
}

/// The engine thread's side of the channels: chapter 4's loop calls it before and after
/// every step.
struct Client<'a> {
    commands: std_mpsc::Receiver<Command>,
    routes: HashMap<RequestId, Route>,
    metrics: &'a Metrics,
    /// The last steps, for the dashboard's snapshots.
    history: History,
}

// ANCHOR: run
fn run(mut engine: Engine<'_>, commands: std_mpsc::Receiver<Command>, metrics: &Metrics) {
    let mut client = Client {
        commands,
        routes: HashMap::new(),
        metrics,
        history: History::default(),
    };
    while let Err(error) = drive(&mut engine, &mut client) {
        // Fail everything in flight rather than spin: the engine is not trusted after an
        // error it did not expect.
        let message = format!("engine error: {error}");
        for (id, route) in client.routes.drain() {
            let _ = route.events.send(Event::Failed {
                choice: route.choice,
                message: message.clone(),
            });
            engine.abort(id);
            engine.take(id);
        }
        publish(&engine, metrics);
    }
}

impl Client<'_> {
    /// Adds every choice of one request, or none: a refused choice aborts those added before.
    /// A choice with the same prompt as the one before it is a fork of the first of them: the
    /// prompt is prefilled once for all its `n` choices.
    fn add(
        &mut self,
        engine: &mut Engine<'_>,
        requests: Vec<Request>,
        processors: Vec<Option<Box<dyn LogitsProcessor>>>,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<Result<Vec<RequestId>, EngineError>>,
    ) {
        let mut ids = Vec::with_capacity(requests.len());
        let mut processors = processors.into_iter();
        // The prompt of the last choice added, and the first choice that had it.
        let mut group: Option<(Vec<u32>, RequestId)> = None;
        for request in requests {
            let processor = processors.next().flatten();
            let added = match &group {
                Some((prompt, parent)) if *prompt == request.prompt => {
                    engine.add_fork(*parent, request, processor)
                }
                _ => {
                    let prompt = request.prompt.clone();
                    let added = match processor {
                        Some(processor) => engine.add_request_with(request, processor),
                        None => engine.add_request(request),
                    };
                    if let Ok(id) = added {
                        group = Some((prompt, id));
                    }
                    added
                }
            };
            match added {
                Ok(id) => ids.push(id),
                Err(error) => {
                    for id in ids {
                        engine.abort(id);
                        engine.take(id);
                    }
                    let _ = reply.send(Err(error));
                    return;
                }
            }
        }
        if reply.send(Ok(ids.clone())).is_ok() {
            for (choice, id) in ids.into_iter().enumerate() {
                let events = events.clone();
                self.routes.insert(id, Route { choice, events });
            }
        } else {
            // The handler is gone already.
            for id in ids {
                engine.abort(id);
                engine.take(id);
            }
        }
    }
}

impl EngineClient for Client<'_> {
    fn poll(&mut self, engine: &mut Engine<'_>) -> ControlFlow<()> {
        // Block only when there is nothing to step.
        let first = if engine.has_unfinished() {
            None
        } else {
            match self.commands.recv() {
                Ok(command) => Some(command),
                Err(_) => return ControlFlow::Break(()), // every handle dropped
            }
        };
        let queued = std::iter::from_fn(|| self.commands.try_recv().ok());
        let mut snapshots = Vec::new();
        for command in first.into_iter().chain(queued).collect::<Vec<_>>() {
            match command {
                Command::Add {
                    requests,
                    processors,
                    events,
                    reply,
                } => self.add(engine, requests, processors, events, reply),
                Command::Abort(id) => end(engine, &mut self.routes, id, None),
                Command::AbortAll => abort_all(engine, &mut self.routes),
                Command::Stop => {
                    abort_all(engine, &mut self.routes);
                    publish(engine, self.metrics);
                    return ControlFlow::Break(());
                }
                Command::Snapshot(reply) => snapshots.push(reply),
            }
        }
        // Clients that went away: free their blocks now, not when they would have finished.
        let gone: Vec<RequestId> = self
            .routes
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            end(engine, &mut self.routes, id, None);
        }
        publish(engine, self.metrics);
        // One snapshot answers every dashboard that asked since the last step; sending on a
        // oneshot never waits for its receiver.
        if !snapshots.is_empty() {
            let snapshot = self.history.snapshot(engine);
            for reply in snapshots {
                let _ = reply.send(snapshot.clone());
            }
        }
        ControlFlow::Continue(())
    }

    fn on_step(&mut self, engine: &mut Engine<'_>, outputs: Vec<RequestOutput>) {
        self.history.record(engine);
        for out in outputs {
            if let Some(route) = self.routes.get(&out.id) {
                let _ = route.events.send(Event::Tokens {
                    choice: route.choice,
                    tokens: out.new_tokens,
                    logprobs: out.logprobs,
                    finished: out.finished,
                });
            }
            if out.finished.is_some() {
                self.routes.remove(&out.id);
            }
        }
        publish(engine, self.metrics);
    }
}
// ANCHOR_END: run

/// Ends every request in flight, telling each handler `abort`.
fn abort_all(engine: &mut Engine<'_>, routes: &mut HashMap<RequestId, Route>) {
    let ids: Vec<RequestId> = routes.keys().copied().collect();
    for id in ids {
        end(engine, routes, id, Some(FinishReason::Abort));
    }
}

/// Ends request `id`: aborts it in the engine, and tells its handler `reason` if given.
fn end(
    engine: &mut Engine<'_>,
    routes: &mut HashMap<RequestId, Route>,
    id: RequestId,
    reason: Option<FinishReason>,
) {
    engine.abort(id);
    engine.take(id);
    if let Some(route) = routes.remove(&id)
        && let Some(finished) = reason
    {
        let _ = route.events.send(Event::Tokens {
            choice: route.choice,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            finished: Some(finished),
        });
    }
}

fn publish(engine: &Engine<'_>, metrics: &Metrics) {
    let scheduler = engine.scheduler();
    let (waiting, running, swapped) = scheduler.queue_lengths();
    let prefix = scheduler.prefix_stats();
    let counters = scheduler.counters();
    metrics.set_engine(EngineGauges {
        running,
        waiting,
        swapped,
        kv_cache_usage: scheduler.kv_usage(),
        prefix_cache_queries: prefix.queried_blocks,
        prefix_cache_hits: prefix.hit_blocks,
        preemptions: counters.preemptions,
        prompt_tokens: counters.prompt_tokens,
        generation_tokens: counters.generation_tokens,
        spec_decode_num_drafts: counters.spec_decode_num_drafts,
        spec_decode_num_draft_tokens: counters.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens: counters.spec_decode_num_accepted_tokens,
    });
}
