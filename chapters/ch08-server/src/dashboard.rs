//! The live engine dashboard: `GET /dashboard/state`, a JSON snapshot of the engine, and
//! `GET /dashboard`, one static page that polls it and draws chapter 3's block tables and
//! chapter 4's queues and steps as they change.
//!
//! ```text
//! handler ──Command::Snapshot──▶ engine thread, between two steps (in poll):
//!                                  queues, block tables, pool   ← the scheduler, read only
//!                                  last steps, preemptions, CoW ← History, recorded per step
//! handler ◀──── EngineSnapshot ──  (one snapshot answers every request queued in that poll)
//!   + LatencySnapshot from the metrics (the numbers /metrics renders)
//! ```
//!
//! Invariants: a snapshot is bounded ([`MAX_LISTED_REQUESTS`] per queue,
//! [`MAX_LISTED_BLOCKS`] per block table, [`STEPS_KEPT`] steps, [`PREEMPTIONS_KEPT`]
//! preemptions; each list says how many it left out); it is built in O(what it lists) on the
//! engine thread and sent through a oneshot channel, so a slow or absent HTTP client never
//! delays a step; it carries no token ids or text, only lengths, ids and counts.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use ch03::BlockId;
use ch04::{Engine, Preemption, RequestId, SeqView, Status};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::metrics::LatencySnapshot;
use crate::routes::client_of;
use crate::state::AppState;

/// Requests listed per queue; the rest are only counted.
pub const MAX_LISTED_REQUESTS: usize = 32;
/// Blocks listed per running request's table; the rest are only counted.
pub const MAX_LISTED_BLOCKS: usize = 64;
/// Steps kept in the history.
pub const STEPS_KEPT: usize = 64;
/// Preemptions kept in the history.
pub const PREEMPTIONS_KEPT: usize = 32;
/// How long a handler waits for the engine thread's snapshot (one step at most, normally).
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(10);

// ANCHOR: snapshot_types
/// What `GET /dashboard/state` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DashboardState {
    pub engine: EngineSnapshot,
    /// The handlers' histograms and finish counts, as `/metrics` has them.
    pub latency: LatencySnapshot,
}

/// The engine between two steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineSnapshot {
    /// Steps run so far (steps that ran at least one sequence).
    pub step: u64,
    pub limits: SnapshotLimits,
    pub config: SchedulerSettings,
    pub running: Listed<RunningRequest>,
    pub waiting: Listed<QueuedRequest>,
    pub swapped: Listed<QueuedRequest>,
    pub kv: KvPoolState,
    /// The last steps, oldest first.
    pub steps: Vec<StepRecord>,
    pub preemptions: Preemptions,
    pub counters: EngineCounters,
    /// Chapter 6's acceptance, when the engine speculates; `null` otherwise.
    pub speculative: Option<Acceptance>,
}

/// The caps this snapshot was taken under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotLimits {
    pub max_listed_requests: usize,
    pub max_listed_blocks: usize,
    pub steps_kept: usize,
    pub preemptions_kept: usize,
}

/// The scheduler's limits (chapter 4's flags).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerSettings {
    pub max_num_seqs: usize,
    /// The token budget of one step.
    pub max_num_batched_tokens: usize,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    /// "recompute" or "swap".
    pub preemption_mode: String,
    pub block_size: usize,
}

/// A queue: its length, and its first `shown` entries in scheduling order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Listed<T> {
    pub total: usize,
    pub shown: Vec<T>,
    /// `total - shown.len()`: entries left out by [`MAX_LISTED_REQUESTS`].
    pub left_out: usize,
}

/// A request that holds blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningRequest {
    pub id: RequestId,
    pub priority: i32,
    pub prompt_len: usize,
    /// Prompt and output tokens so far.
    pub num_tokens: usize,
    /// Positions holding K/V.
    pub num_computed: usize,
    /// Positions the prefix cache supplied at admission.
    pub num_cached_tokens: usize,
    /// "prefill" while prompt positions remain to compute, else "decode".
    pub phase: String,
    pub num_blocks: usize,
    /// The table's first [`MAX_LISTED_BLOCKS`] blocks, logical order.
    pub blocks: Vec<BlockCell>,
    pub blocks_left_out: usize,
}

/// One entry of a block table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockCell {
    /// The physical block.
    pub id: BlockId,
    /// Tables holding it: above 1, it is shared, and a write would copy it first.
    pub refs: u32,
    pub kind: BlockKind,
    /// Positions of this block that hold the sequence's K/V (0..=block_size).
    pub filled: usize,
}

/// What a block is to its table; the first that applies, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockKind {
    /// Held by more than one table.
    Shared,
    /// This sequence's private copy of a shared block (copy-on-write), made while it runs.
    Copied,
    /// Reused from the prefix cache at admission (now held by this table alone).
    Prefix,
    /// Registered in the prefix cache (full, read-only, offered to later prompts).
    Cached,
    /// Held by this table alone, being written.
    Private,
}

/// A request without blocks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueuedRequest {
    pub id: RequestId,
    pub priority: i32,
    pub prompt_len: usize,
    pub num_tokens: usize,
    /// Positions kept outside the pool (swapped) or 0 (waiting: recomputed on admission).
    pub num_computed: usize,
}

/// The KV pool: `used + free = num_blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KvPoolState {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Blocks held by some table.
    pub used_blocks: usize,
    /// Blocks an allocation can have: the free list and `cached_free_blocks`.
    pub free_blocks: usize,
    /// Free blocks that still hold a cached prefix (evicted last-released-last).
    pub cached_free_blocks: usize,
    /// `used / num_blocks`: `kiln:kv_cache_usage_perc`.
    pub usage: f64,
}

/// One step's token budget, split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    /// Prompt tokens run, in `prefill_chunks` pieces (a whole prompt is one piece).
    pub prefill_tokens: usize,
    pub prefill_chunks: usize,
    /// Decode tokens run (with speculation, each decode's drafts too), by `decodes` sequences.
    pub decode_tokens: usize,
    pub decodes: usize,
    /// `max_num_batched_tokens`.
    pub budget: usize,
    pub admitted: usize,
    pub preempted: usize,
    pub copies: usize,
}

/// Preemptions: the cumulative count (`kiln:num_preemptions_total`) and the latest ones.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preemptions {
    pub total: u64,
    /// Oldest first.
    pub recent: Vec<PreemptionRecord>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptionRecord {
    pub step: u64,
    pub request: RequestId,
}

/// The engine's cumulative counters, as `/metrics` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineCounters {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Copies-on-write since the server started.
    pub copies_on_write: u64,
}

/// Chapter 6: draft tokens verified and accepted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Acceptance {
    pub drafts: u64,
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
    /// `accepted_tokens / draft_tokens`; `null` before the first draft.
    pub acceptance_rate: Option<f64>,
}
// ANCHOR_END: snapshot_types

/// What the engine thread remembers between snapshots: the last steps, preemptions and the
/// blocks copied on write. Bounded like the snapshot.
#[derive(Debug, Default)]
pub struct History {
    last_step: u64,
    steps: VecDeque<StepRecord>,
    preemptions: VecDeque<PreemptionRecord>,
    /// Private copies made by copy-on-write, per request still running.
    copies: HashMap<RequestId, Vec<BlockId>>,
    copies_on_write: u64,
}

impl History {
    // ANCHOR: record
    /// Records the step the engine just ran (a no-op if it ran none since the last call).
    pub fn record(&mut self, engine: &Engine<'_>) {
        let scheduler = engine.scheduler();
        let step = scheduler.counters().steps;
        if step == self.last_step {
            return;
        }
        self.last_step = step;
        let trace = scheduler.last_step();
        let mut record = StepRecord {
            step,
            prefill_tokens: 0,
            prefill_chunks: 0,
            decode_tokens: 0,
            decodes: 0,
            budget: scheduler.config().max_num_batched_tokens,
            admitted: trace.admitted.len(),
            preempted: trace.preempted.len(),
            copies: trace.copied.len(),
        };
        for &(_, tokens, prompt) in &trace.scheduled {
            if prompt {
                record.prefill_tokens += tokens;
                record.prefill_chunks += 1;
            } else {
                record.decode_tokens += tokens;
                record.decodes += 1;
            }
        }
        push_bounded(&mut self.steps, record, STEPS_KEPT);
        for &request in &trace.preempted {
            push_bounded(
                &mut self.preemptions,
                PreemptionRecord { step, request },
                PREEMPTIONS_KEPT,
            );
        }
        // A preempted request's blocks went back to the pool: so did its copies.
        for id in &trace.preempted {
            self.copies.remove(id);
        }
        for &(id, copy) in &trace.copied {
            let copies = self.copies.entry(id).or_default();
            if copies.len() < MAX_LISTED_BLOCKS {
                copies.push(copy.dst);
            }
        }
        self.copies_on_write += trace.copied.len() as u64;
        // Forget the copies of requests that stopped running (finished, preempted).
        self.copies
            .retain(|&id, _| scheduler.status(id) == Some(Status::Running));
    }
    // ANCHOR_END: record

    // ANCHOR: snapshot
    /// The engine now, bounded; call it between steps.
    pub fn snapshot(&self, engine: &Engine<'_>) -> EngineSnapshot {
        let scheduler = engine.scheduler();
        let manager = scheduler.block_manager();
        let config = scheduler.config();
        let block_size = manager.block_size();
        let counters = scheduler.counters();
        let prefix = scheduler.prefix_stats();

        let mut by_status: [Vec<SeqView<'_>>; 3] = Default::default();
        for seq in scheduler.sequences() {
            let queue = match seq.status {
                Status::Running => 0,
                Status::Waiting => 1,
                Status::Swapped => 2,
                Status::Finished(_) => continue,
            };
            by_status[queue].push(seq);
        }
        // Scheduling order: priority, then arrival (ids are in arrival order).
        for queue in &mut by_status {
            queue.sort_unstable_by_key(|s| (s.priority, s.id));
        }
        let [running, waiting, swapped] = by_status;

        let running = listed(&running, |seq| {
            let copies = self.copies.get(&seq.id).map_or(&[][..], Vec::as_slice);
            let prefix_blocks = seq.num_cached_tokens.div_ceil(block_size);
            let blocks = seq
                .blocks
                .iter()
                .take(MAX_LISTED_BLOCKS)
                .enumerate()
                .map(|(i, &id)| {
                    let refs = manager.ref_count(id);
                    let kind = if refs > 1 {
                        BlockKind::Shared
                    } else if copies.contains(&id) {
                        BlockKind::Copied
                    } else if i < prefix_blocks {
                        BlockKind::Prefix
                    } else if manager.is_cached(id) {
                        BlockKind::Cached
                    } else {
                        BlockKind::Private
                    };
                    let filled = seq
                        .num_computed
                        .saturating_sub(i * block_size)
                        .min(block_size);
                    BlockCell {
                        id,
                        refs,
                        kind,
                        filled,
                    }
                })
                .collect();
            RunningRequest {
                id: seq.id,
                priority: seq.priority,
                prompt_len: seq.prompt_len,
                num_tokens: seq.num_tokens,
                num_computed: seq.num_computed,
                num_cached_tokens: seq.num_cached_tokens,
                phase: if seq.num_computed < seq.prompt_len {
                    "prefill"
                } else {
                    "decode"
                }
                .into(),
                num_blocks: seq.blocks.len(),
                blocks,
                blocks_left_out: seq.blocks.len().saturating_sub(MAX_LISTED_BLOCKS),
            }
        });
        let queued = |seq: &SeqView<'_>| QueuedRequest {
            id: seq.id,
            priority: seq.priority,
            prompt_len: seq.prompt_len,
            num_tokens: seq.num_tokens,
            num_computed: seq.num_computed,
        };

        let num_blocks = manager.num_blocks();
        let free_blocks = manager.num_free_blocks();
        let speculative = engine.speculator().map(|_| Acceptance {
            drafts: counters.spec_decode_num_drafts,
            draft_tokens: counters.spec_decode_num_draft_tokens,
            accepted_tokens: counters.spec_decode_num_accepted_tokens,
            acceptance_rate: (counters.spec_decode_num_draft_tokens > 0).then(|| {
                counters.spec_decode_num_accepted_tokens as f64
                    / counters.spec_decode_num_draft_tokens as f64
            }),
        });
        EngineSnapshot {
            step: counters.steps,
            limits: SnapshotLimits {
                max_listed_requests: MAX_LISTED_REQUESTS,
                max_listed_blocks: MAX_LISTED_BLOCKS,
                steps_kept: STEPS_KEPT,
                preemptions_kept: PREEMPTIONS_KEPT,
            },
            config: SchedulerSettings {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                enable_chunked_prefill: config.enable_chunked_prefill,
                enable_prefix_caching: config.enable_prefix_caching,
                preemption_mode: match config.preemption {
                    Preemption::Recompute => "recompute",
                    Preemption::Swap => "swap",
                }
                .into(),
                block_size,
            },
            running,
            waiting: listed(&waiting, queued),
            swapped: listed(&swapped, queued),
            kv: KvPoolState {
                num_blocks,
                block_size,
                used_blocks: num_blocks - free_blocks,
                free_blocks,
                cached_free_blocks: manager.num_evictable_blocks(),
                // The same expression as the gauge's, so the two are equal to the bit.
                usage: scheduler.kv_usage(),
            },
            steps: self.steps.iter().copied().collect(),
            preemptions: Preemptions {
                total: counters.preemptions,
                recent: self.preemptions.iter().copied().collect(),
            },
            counters: EngineCounters {
                prompt_tokens: counters.prompt_tokens,
                generation_tokens: counters.generation_tokens,
                prefix_cache_queries: prefix.queried_blocks,
                prefix_cache_hits: prefix.hit_blocks,
                copies_on_write: self.copies_on_write,
            },
            speculative,
        }
    }
    // ANCHOR_END: snapshot
}

fn push_bounded<T>(queue: &mut VecDeque<T>, item: T, cap: usize) {
    if queue.len() == cap {
        queue.pop_front();
    }
    queue.push_back(item);
}

fn listed<'a, T>(seqs: &[SeqView<'a>], describe: impl FnMut(&SeqView<'a>) -> T) -> Listed<T> {
    let shown: Vec<T> = seqs
        .iter()
        .take(MAX_LISTED_REQUESTS)
        .map(describe)
        .collect();
    Listed {
        total: seqs.len(),
        left_out: seqs.len() - shown.len(),
        shown,
    }
}

// ANCHOR: handlers
/// The page: static, with its script and style inline; it holds no data, so it is served
/// without a key (the page asks for one when the state endpoint answers 401).
pub async fn page() -> Response {
    (
        [
            (CONTENT_TYPE, "text/html; charset=utf-8"),
            (CACHE_CONTROL, "no-cache"),
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:; frame-ancestors 'none'",
            ),
        ],
        include_str!("dashboard.html"),
    )
        .into_response()
}

/// `GET /dashboard/state`: behind the API key, like `/v1/models`, since it describes other
/// clients' requests (lengths and ids, never their text).
pub async fn state(State(state): State<Arc<AppState>>, parts: Parts) -> Response {
    if let Err(error) = state.authorize_client(&parts.headers, client_of(&parts.extensions)) {
        return error.into_response();
    }
    let engine = match tokio::time::timeout(SNAPSHOT_TIMEOUT, state.engine.snapshot()).await {
        Ok(Ok(engine)) => engine,
        Ok(Err(_)) => return ApiError::unavailable("the engine has stopped").into_response(),
        Err(_) => {
            return ApiError::unavailable("the engine did not answer in time").into_response();
        }
    };
    let body = DashboardState {
        engine,
        latency: state.metrics.latency(),
    };
    (
        [
            (CONTENT_TYPE, "application/json"),
            (CACHE_CONTROL, "no-store"),
        ],
        crate::routes::to_json(&body),
    )
        .into_response()
}
// ANCHOR_END: handlers

#[cfg(test)]
mod tests {
    use super::*;
    use ch01::{Llama, fixtures_dir};
    use ch03::KvPool;
    use ch04::{CpuExecutor, EngineConfig, Request};

    fn engine(model: &Llama, blocks: usize, config: EngineConfig) -> Engine<'_> {
        engine_of(model, 4, blocks, config)
    }

    fn engine_of(
        model: &Llama,
        block_size: usize,
        blocks: usize,
        config: EngineConfig,
    ) -> Engine<'_> {
        let pool = KvPool::<f32>::new(&model.config, block_size, blocks).unwrap();
        Engine::new(CpuExecutor::new(model, pool), config).unwrap()
    }

    /// Prefix caching on, no free-block watermark: every block can be shared or handed out.
    fn prefix_caching() -> EngineConfig {
        EngineConfig {
            enable_prefix_caching: true,
            watermark: 0.0,
            ..EngineConfig::default()
        }
    }

    fn steps(engine: &mut Engine<'_>, history: &mut History, n: usize) {
        for _ in 0..n {
            engine.step_or_stall().unwrap();
            history.record(engine);
        }
    }

    /// Two requests with the same 10-token prompt under prefix caching: the second reuses
    /// the first's two full blocks (shared, 2 refs each) and writes its own third block.
    #[test]
    fn snapshot_shows_shared_prefix_blocks_and_the_pool() {
        let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
        let mut engine = engine(&model, 16, prefix_caching());
        let mut history = History::default();
        let prompt: Vec<u32> = (1..=10).collect();
        let first = engine
            .add_request(Request::greedy(prompt.clone(), 20))
            .unwrap();
        steps(&mut engine, &mut history, 2); // the prompt, then one decode
        let second = engine.add_request(Request::greedy(prompt, 20)).unwrap();
        steps(&mut engine, &mut history, 1);

        let snap = history.snapshot(&engine);
        assert_eq!(snap.step, 3);
        assert_eq!(snap.running.total, 2);
        assert_eq!((snap.waiting.total, snap.swapped.total), (0, 0));
        let [a, b] = &snap.running.shown[..] else {
            panic!("{:?}", snap.running)
        };
        assert_eq!((a.id, b.id), (first, second));
        assert_eq!(b.num_cached_tokens, 8);
        assert_eq!(
            &a.blocks[..2],
            &b.blocks[..2],
            "the prefix blocks are shared"
        );
        for cell in &b.blocks[..2] {
            assert_eq!(
                (cell.refs, cell.kind, cell.filled),
                (2, BlockKind::Shared, 4)
            );
        }
        assert_eq!(b.blocks[2].refs, 1);
        assert_ne!(a.blocks[2].id, b.blocks[2].id);
        assert_eq!(a.phase, "decode");

        // Pool: 16 blocks; the first holds 3 (12 positions), the second 1 more of its own.
        assert_eq!(snap.kv.num_blocks, 16);
        assert_eq!(snap.kv.used_blocks, 4);
        assert_eq!(snap.kv.used_blocks + snap.kv.free_blocks, 16);
        assert_eq!(snap.kv.usage, engine.scheduler().kv_usage());

        // Steps: a 10-token prefill; one decode; the second's 2-token prefill beside a decode.
        let split: Vec<_> = snap
            .steps
            .iter()
            .map(|s| {
                (
                    s.prefill_tokens,
                    s.prefill_chunks,
                    s.decode_tokens,
                    s.decodes,
                )
            })
            .collect();
        assert_eq!(split, [(10, 1, 0, 0), (0, 0, 1, 1), (2, 1, 1, 1)]);
        assert_eq!(snap.counters.prefix_cache_hits, 2);
        assert_eq!(snap.preemptions.total, 0);
        assert!(snap.speculative.is_none());
        // The JSON parses back to the same snapshot.
        let json = serde_json::to_string(&snap).unwrap();
        assert_eq!(serde_json::from_str::<EngineSnapshot>(&json).unwrap(), snap);
    }

    /// A full prefix hit (the whole prompt in cached blocks) copies the last block on write,
    /// and a pool too small for both requests preempts one; both show in the snapshot, and
    /// the lists respect their caps.
    #[test]
    fn snapshot_shows_copy_on_write_preemptions_and_caps() {
        let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
        let mut engine = engine(&model, 16, prefix_caching());
        let mut history = History::default();
        // 8 tokens: two full blocks, both cached after the first prefill.
        let prompt: Vec<u32> = (1..=8).collect();
        engine
            .add_request(Request::greedy(prompt.clone(), 30))
            .unwrap();
        steps(&mut engine, &mut history, 2);
        let second = engine.add_request(Request::greedy(prompt, 30)).unwrap();
        steps(&mut engine, &mut history, 1);
        let snap = history.snapshot(&engine);
        let b = snap.running.shown.iter().find(|r| r.id == second).unwrap();
        assert_eq!(
            b.num_cached_tokens, 7,
            "a full hit recomputes the last token"
        );
        assert_eq!(b.blocks[1].kind, BlockKind::Copied, "{:?}", b.blocks);
        assert_eq!(b.blocks[1].refs, 1);
        assert_eq!(b.blocks[0].kind, BlockKind::Shared);
        assert_eq!(snap.counters.copies_on_write, 1);
        assert_eq!(snap.steps.last().unwrap().copies, 1);

        // Run on until the pool (16 blocks of 4: 64 positions) cannot hold both (76).
        while engine.scheduler().counters().preemptions == 0 {
            assert!(engine.has_unfinished(), "no preemption happened");
            steps(&mut engine, &mut history, 1);
        }
        let snap = history.snapshot(&engine);
        assert_eq!(snap.preemptions.total, 1);
        let recent = snap.preemptions.recent[0];
        assert_eq!(recent.request, second, "the latest arrival is the victim");
        assert_eq!(recent.step, snap.step);
        assert_eq!(snap.steps.last().unwrap().preempted, 1);
        // The victim goes back to the queue, its K/V dropped. Its prompt's blocks, which the
        // first request holds, cost it no free blocks, so it may be readmitted in the same
        // step, its recompute starting from the cached prefix.
        let waits = snap
            .waiting
            .shown
            .iter()
            .any(|r| r.id == second && r.num_computed == 0);
        let readmitted = snap
            .running
            .shown
            .iter()
            .any(|r| r.id == second && r.num_cached_tokens > 0);
        assert!(waits || readmitted, "{:?}", snap.waiting);
        assert_eq!(snap.waiting.total, usize::from(waits));
        while engine.has_unfinished() {
            steps(&mut engine, &mut history, 1);
        }
        let snap = history.snapshot(&engine);
        assert_eq!(snap.running.total + snap.waiting.total, 0);
        assert_eq!(snap.kv.used_blocks, 0);
        assert!(
            history.copies.is_empty(),
            "copies of ended requests forgotten"
        );
        assert!(snap.steps.len() <= STEPS_KEPT);
        engine.scheduler().check_invariants().unwrap();
    }

    /// Drafts the sequence's last token twice; verifies greedily (accepts a draft while it is
    /// the target's argmax, then adds the target's next token).
    struct RepeatLast;

    fn argmax(row: &[f32]) -> u32 {
        let best = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i);
        best as u32
    }

    impl ch04::Speculator for RepeatLast {
        fn num_speculative_tokens(&self) -> usize {
            2
        }
        fn disable_by_batch_size(&self) -> Option<usize> {
            None
        }
        fn propose(
            &mut self,
            seqs: &[ch04::DraftSeq],
            drafts: &mut [ch04::Draft],
        ) -> Result<(), ch04::ExecutorError> {
            for (seq, draft) in seqs.iter().zip(drafts) {
                let last = *seq.tokens.last().unwrap_or(&0);
                draft.tokens = vec![last; seq.max_drafts.min(2)];
            }
            Ok(())
        }
        fn verify(
            &mut self,
            _sampler: &mut ch01::Sampler,
            rows: ndarray::ArrayView2<f32>,
            _prompt: &[u32],
            _output: &[u32],
            draft: &ch04::Draft,
            accepted: &mut Vec<u32>,
        ) -> Result<(), ch01::sampler::SamplingError> {
            for (i, row) in rows.rows().into_iter().enumerate() {
                let best = argmax(row.as_slice().unwrap());
                accepted.push(best);
                if draft.tokens.get(i) != Some(&best) {
                    break;
                }
            }
            Ok(())
        }
        fn release(&mut self, _id: RequestId) {}
    }

    /// With a speculator, the snapshot reports its acceptance from the engine's counters, and
    /// each decode's drafts count in its step's decode tokens.
    #[test]
    fn snapshot_reports_speculative_acceptance() {
        let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
        let mut engine =
            engine(&model, 32, EngineConfig::default()).with_speculator(Box::new(RepeatLast));
        let mut history = History::default();
        let snap = history.snapshot(&engine);
        let none_yet = snap.speculative.expect("a speculator is on");
        assert_eq!((none_yet.draft_tokens, none_yet.acceptance_rate), (0, None));
        engine
            .add_request(Request::greedy(vec![5, 6, 7], 12))
            .unwrap();
        while engine.has_unfinished() {
            steps(&mut engine, &mut history, 1);
        }
        let counters = engine.scheduler().counters();
        let snap = history.snapshot(&engine);
        let spec = snap.speculative.unwrap();
        assert!(spec.draft_tokens > 0);
        assert_eq!(spec.drafts, counters.spec_decode_num_drafts);
        assert_eq!(spec.draft_tokens, counters.spec_decode_num_draft_tokens);
        assert_eq!(
            spec.accepted_tokens,
            counters.spec_decode_num_accepted_tokens
        );
        let rate = spec.accepted_tokens as f64 / spec.draft_tokens as f64;
        assert_eq!(spec.acceptance_rate, Some(rate));
        // Every step after the prefill decodes one token and verifies its drafts.
        let run: usize = snap.steps.iter().map(|s| s.decode_tokens).sum();
        let decodes: usize = snap.steps.iter().map(|s| s.decodes).sum();
        assert_eq!(run as u64, decodes as u64 + spec.draft_tokens);
    }

    #[test]
    fn lists_are_capped_and_say_what_they_left_out() {
        let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
        let config = EngineConfig {
            max_num_seqs: 4,
            ..EngineConfig::default()
        };
        // Blocks of one position: a table outgrows the listed blocks within the test.
        let mut engine = engine_of(&model, 1, 1024, config);
        let total = MAX_LISTED_REQUESTS + 10;
        for i in 0..total as u32 {
            engine
                .add_request(Request::greedy(vec![1 + i % 7; 3], 200))
                .unwrap();
        }
        let mut history = History::default();
        let snap = history.snapshot(&engine);
        assert_eq!(snap.waiting.total, total);
        assert_eq!(snap.waiting.shown.len(), MAX_LISTED_REQUESTS);
        assert_eq!(snap.waiting.left_out, 10);
        assert_eq!(snap.waiting.shown[0].id, 0, "scheduling order");
        assert!(snap.steps.is_empty());
        steps(&mut engine, &mut history, STEPS_KEPT + 5);
        let snap = history.snapshot(&engine);
        assert_eq!(snap.running.total, 4);
        assert_eq!(snap.waiting.total, total - 4);
        assert_eq!(snap.steps.len(), STEPS_KEPT);
        assert_eq!(snap.steps.last().unwrap().step, snap.step);
        assert_eq!(snap.steps[0].step, snap.step - STEPS_KEPT as u64 + 1);
        let first = &snap.running.shown[0];
        assert_eq!(first.num_blocks, 3 + STEPS_KEPT + 4);
        assert_eq!(first.blocks.len(), MAX_LISTED_BLOCKS);
        assert_eq!(first.blocks_left_out, first.num_blocks - MAX_LISTED_BLOCKS);
        let json = serde_json::to_string(&snap).unwrap();
        assert!(json.len() < 64 << 10, "{} bytes", json.len());
    }
}
