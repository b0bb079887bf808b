//! [`ThreadComm`]: ranks as threads of one process, meeting at a barrier over shared buffers.
//!
//! ```text
//! all-reduce on rank r:  write buf into slot[r] ── barrier ── buf = slot[0] + slot[1] + … ── barrier
//!                                                  (every contribution is in)    (everyone has read:
//!                                                                                 slots may be reused)
//! ```
//! Each rank sums the slots itself, in rank order, so every rank computes the same bits. This
//! reads `world · n` floats per rank where a ring all-reduce moves `2 (world − 1) / world · n`:
//! the simple version, and the oracle the other communicators are tested against. Nothing is
//! allocated once the slots have grown to the largest message (`tests/thread_comm_alloc.rs`),
//! unless the lengths disagree (the error lists them).
//!
//! A rank that panics or is dropped marks the group lost: the ranks waiting at the barrier, and
//! every later collective, return [`CommError::RankLost`] instead of waiting forever.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};

use super::{CommError, Communicator};

/// One rank of a group made by [`thread_group`]; move each into its own thread.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

/// What the ranks of one group share.
struct Shared {
    slots: Vec<RwLock<Vec<f32>>>, // [world] each rank's contribution to the collective in flight
    bytes: RwLock<Vec<u8>>,       // the broadcast in flight
    barrier: Rendezvous,
}

/// `world` handles on one new group, rank 0 first.
pub fn thread_group(world: usize) -> Result<Vec<ThreadComm>, CommError> {
    if world == 0 {
        return Err(CommError::Backend("a group needs at least one rank".into()));
    }
    let shared = Arc::new(Shared {
        slots: (0..world).map(|_| RwLock::new(Vec::new())).collect(),
        bytes: RwLock::new(Vec::new()),
        barrier: Rendezvous::new(world),
    });
    Ok((0..world)
        .map(|rank| ThreadComm {
            rank,
            shared: Arc::clone(&shared),
        })
        .collect())
}

impl ThreadComm {
    /// Puts `data` in this rank's slot (the others read it after the next barrier).
    fn publish(&mut self, data: &[f32]) {
        let mut slot = write(&self.shared.slots[self.rank]);
        slot.clear();
        slot.extend_from_slice(data);
    }

    /// Waits for every rank's slot, runs `read` over all of them, and waits until every rank
    /// has read. Both barriers are passed whatever `read` returns, so an error on one rank
    /// never leaves the others waiting.
    fn meet<T>(
        &mut self,
        read: impl FnOnce(&[RwLock<Vec<f32>>]) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        self.shared.barrier.wait()?;
        let result = read(&self.shared.slots);
        self.shared.barrier.wait()?;
        result
    }
}

/// Every slot's length, checked equal: the same error on every rank when they differ. Only
/// that error allocates (the list of lengths it names): agreeing collectives allocate nothing.
fn equal_lengths(op: &'static str, slots: &[RwLock<Vec<f32>>]) -> Result<usize, CommError> {
    let len = |s: &RwLock<Vec<f32>>| read(s).len();
    let first = slots.first().map_or(0, len);
    if slots.iter().any(|s| len(s) != first) {
        let lens = slots.iter().map(len).collect();
        return Err(CommError::LengthMismatch { op, lens });
    }
    Ok(first)
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.slots.len()
    }

    // ANCHOR: thread_all_reduce
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        // ANCHOR: task_8_5
        self.publish(buf);
        self.meet(|slots| {
            // Every rank sums all the parts itself, in rank order: the same bits everywhere.
            equal_lengths("all-reduce", slots)?;
            buf.copy_from_slice(&read(&slots[0]));
            for slot in &slots[1..] {
                for (b, v) in buf.iter_mut().zip(read(slot).iter()) {
                    *b += v;
                }
            }
            Ok(())
        })
        // ANCHOR_END: task_8_5
    }
    // ANCHOR_END: thread_all_reduce

    fn all_gather(&mut self, part: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        let world = self.world();
        self.publish(part);
        self.meet(|slots| {
            let n = equal_lengths("all-gather", slots)?;
            if out.len() != world * n {
                return Err(CommError::GatherShape {
                    out: out.len(),
                    world,
                    part: n,
                });
            }
            for (chunk, slot) in out.chunks_exact_mut(n.max(1)).zip(slots) {
                chunk.copy_from_slice(&read(slot));
            }
            Ok(())
        })
    }

    fn broadcast(&mut self, buf: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        let world = self.world();
        if root >= world {
            return Err(CommError::RootOutOfRange { root, world });
        }
        if self.rank == root {
            let mut shared = write(&self.shared.bytes);
            shared.clear();
            shared.extend_from_slice(buf);
        }
        self.shared.barrier.wait()?;
        if self.rank != root {
            buf.clear();
            buf.extend_from_slice(&read(&self.shared.bytes));
        }
        self.shared.barrier.wait()
    }
}

impl Drop for ThreadComm {
    /// A group missing a rank cannot meet again: wake everyone waiting with the news.
    fn drop(&mut self) {
        self.shared.barrier.lose();
    }
}

/// A reusable barrier for `world` ranks that can be broken: once a rank is lost, every wait
/// returns [`CommError::RankLost`]. (`std::sync::Barrier` would wait forever.)
struct Rendezvous {
    world: usize,
    state: Mutex<BarrierState>,
    all_here: Condvar,
}

struct BarrierState {
    arrived: usize,
    /// Counts the completed meetings: a waiter leaves when it changes.
    generation: u64,
    lost: bool,
}

impl Rendezvous {
    fn new(world: usize) -> Self {
        Rendezvous {
            world,
            state: Mutex::new(BarrierState {
                arrived: 0,
                generation: 0,
                lost: false,
            }),
            all_here: Condvar::new(),
        }
    }

    fn wait(&self) -> Result<(), CommError> {
        let mut state = lock(&self.state);
        if state.lost {
            return Err(CommError::RankLost);
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.world {
            state.arrived = 0;
            state.generation += 1;
            self.all_here.notify_all();
            return Ok(());
        }
        while state.generation == generation && !state.lost {
            state = self
                .all_here
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        if state.generation == generation {
            return Err(CommError::RankLost);
        }
        Ok(())
    }

    fn lose(&self) {
        lock(&self.state).lost = true;
        self.all_here.notify_all();
    }
}

// The locks guard plain buffers that no code panics while holding, so a poisoned lock's data
// is still whole: take it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}
