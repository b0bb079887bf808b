//! The NCCL communicator (feature `nccl`) on the GPUs this machine has, one rank per GPU: every
//! collective against the sequential reference on random buffers of random lengths, the same
//! bits on every rank, the errors of the seam (mismatched lengths, a wrong gather output, a bad
//! root), and the tensor-parallel executor over NCCL ranks against one rank.
//!
//! Needs an NVIDIA driver and NCCL: without them the tests print that they skipped, unless
//! `KILN_REQUIRE_GPU=1` (set by `just gpu-check`).

use ch01::linear::DenseLoader;
use ch01::testing::{Tolerance, assert_close_shaped};
use ch01::{Llama, fixtures_dir};
use ch03::KvPool;
use ch04::{CpuExecutor, Executor, ScheduledSeq, SchedulerOutput};
use ch08_tensor_parallel::comm::{NcclComm, nccl_group};
use ch08_tensor_parallel::{
    CommError, Communicator, KvBlocks, TensorParallelExecutor, load_shards,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Held by each test while it uses the GPUs: two groups whose collectives queue in different
/// orders on two GPUs' streams would wait on each other for ever, so tests take turns.
fn one_group_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// A group over every GPU (at most 8), or `None` (skipped) without a driver or NCCL.
fn every_gpu() -> Option<Vec<NcclComm>> {
    let required = std::env::var_os("KILN_REQUIRE_GPU").is_some();
    // SAFETY: only tries to open the library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        assert!(
            !required,
            "KILN_REQUIRE_GPU is set but no CUDA driver can be loaded"
        );
        eprintln!("skipped: no CUDA driver on this machine");
        return None;
    }
    let count = cudarc::driver::CudaContext::device_count().unwrap() as usize;
    let ordinals: Vec<usize> = (0..count.min(8)).collect();
    match nccl_group(&ordinals) {
        Ok(group) => Some(group),
        Err(error) => {
            assert!(!required, "KILN_REQUIRE_GPU is set but: {error}");
            eprintln!("skipped: {error}");
            None
        }
    }
}

/// Runs `body` on every rank, each on its own thread; the results in rank order.
fn on_ranks<T: Send>(comms: &mut [NcclComm], body: impl Fn(&mut NcclComm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .map(|comm| {
                let body = &body;
                s.spawn(move || body(comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn collectives_equal_the_sequential_reference_on_every_rank() {
    let _turn = one_group_at_a_time();
    let Some(mut group) = every_gpu() else { return };
    let world = group.len();
    let mut rng = ChaCha8Rng::seed_from_u64(82);
    for case in 0..24 {
        let len = rng.random_range(0..5000usize);
        let parts: Vec<Vec<f32>> = (0..world)
            .map(|_| (0..len).map(|_| rng.random_range(-10.0f32..10.0)).collect())
            .collect();
        let root = rng.random_range(0..world);
        let bytes: Vec<u8> = (0..rng.random_range(0..3000))
            .map(|_| rng.random())
            .collect();
        let results = on_ranks(&mut group, |comm| {
            let r = comm.rank();
            let mut sum = parts[r].clone();
            comm.all_reduce_sum(&mut sum).unwrap();
            let mut gathered = vec![0.0f32; world * len];
            comm.all_gather(&parts[r], &mut gathered).unwrap();
            let mut message = if r == root { bytes.clone() } else { vec![7; 3] };
            comm.broadcast(&mut message, root).unwrap();
            (sum, gathered, message)
        });
        let mut want = parts[0].clone();
        for part in &parts[1..] {
            want.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
        let concatenated: Vec<f32> = parts.concat();
        for (rank, (sum, gathered, message)) in results.iter().enumerate() {
            // NCCL sums in its own order: equal to rank order within f32's rounding.
            assert_close_shaped(
                &format!("case {case}: all-reduce on rank {rank}"),
                sum,
                &want,
                &[len],
                Tolerance::F32,
            );
            assert_eq!(
                sum, &results[0].0,
                "case {case}: rank {rank}'s sum differs from rank 0's"
            );
            assert_eq!(
                gathered, &concatenated,
                "case {case}: all-gather on rank {rank}"
            );
            assert_eq!(
                message, &bytes,
                "case {case}: broadcast from {root} on rank {rank}"
            );
        }
    }
}

/// A bad root or gather output is an error on each rank that passed one (every rank, or rank 0
/// alone, whose peers then finish the gather), lengths that differ are one on every rank, and
/// the group works after all of them.
#[test]
fn the_seam_errors_are_errors_where_they_happen_and_the_group_goes_on() {
    let _turn = one_group_at_a_time();
    let Some(mut group) = every_gpu() else { return };
    let world = group.len();
    let results = on_ranks(&mut group, |comm| {
        let mut wrong_out = vec![0.0f32; world * 3 + 1];
        let gather = comm.all_gather(&[1.0, 2.0, 3.0], &mut wrong_out);
        // Only rank 0's output is the wrong size: an error there, and the others do not hang.
        let mut out = vec![0.0f32; world * 2 + usize::from(comm.rank() == 0)];
        let gather_on_rank0 = (comm.rank(), comm.all_gather(&[1.0, 2.0], &mut out));
        let root = comm.broadcast(&mut vec![1], world);
        // Lengths that differ between ranks (with one rank, nothing can differ).
        let mut buf = vec![1.0f32; 4 + comm.rank()];
        let mismatch = comm.all_reduce_sum(&mut buf);
        // The group goes on after the errors.
        let mut after = vec![comm.rank() as f32; 5];
        comm.all_reduce_sum(&mut after).unwrap();
        (gather, gather_on_rank0, root, mismatch, after)
    });
    let ranks_sum = (world * (world - 1) / 2) as f32;
    for (gather, (rank, gather_on_rank0), root, mismatch, after) in results {
        assert!(
            matches!(gather, Err(CommError::GatherShape { .. })),
            "{gather:?}"
        );
        match rank {
            0 => assert!(
                matches!(gather_on_rank0, Err(CommError::GatherShape { .. })),
                "{gather_on_rank0:?}"
            ),
            _ => assert!(gather_on_rank0.is_ok(), "rank {rank}: {gather_on_rank0:?}"),
        }
        assert!(
            matches!(root, Err(CommError::RootOutOfRange { .. })),
            "{root:?}"
        );
        match world {
            1 => assert!(mismatch.is_ok()),
            _ => assert!(
                matches!(mismatch, Err(CommError::LengthMismatch { .. })),
                "{mismatch:?}"
            ),
        }
        assert_eq!(after, vec![ranks_sum; 5]);
    }
}

/// The tensor-parallel executor with its ranks meeting over NCCL (one rank per GPU) against
/// chapter 4's executor on the whole model: a prefill and decode steps, within f32's tolerance.
#[test]
fn tensor_parallel_over_nccl_equals_one_rank() {
    let _turn = one_group_at_a_time();
    let Some(group) = every_gpu() else { return };
    let world = group.len();
    let dir = fixtures_dir().join("shakespeare-small");
    if ch08_tensor_parallel::load::check_world(&ch01::LlamaConfig::from_dir(&dir).unwrap(), world)
        .is_err()
    {
        eprintln!("skipped: {world} GPUs do not split shakespeare-small");
        return;
    }
    let whole = Llama::load(&dir).unwrap();
    let mut reference = CpuExecutor::new(&whole, KvPool::<f32>::new(&whole.config, 4, 8).unwrap());
    let comms = group
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Communicator>)
        .collect();
    let shards = load_shards(&dir, &DenseLoader, world).unwrap();
    let mut tp =
        TensorParallelExecutor::with_comms(shards, comms, 4, KvBlocks::Count(8), 1).unwrap();
    let prompt: Vec<u32> = vec![3, 17, 99, 250, 7, 1024, 2100, 4095, 5, 64, 1, 2, 900];
    let step = |tokens: Vec<u32>, start_pos: usize, rows: usize| SchedulerOutput {
        seqs: vec![ScheduledSeq {
            id: 0,
            tokens,
            start_pos,
            block_table: vec![0, 1, 2, 3, 4],
            logit_rows: rows,
        }],
        ..SchedulerOutput::default()
    };
    let steps = [
        step(prompt.clone(), 0, prompt.len()),
        step(vec![77], prompt.len(), 1),
        step(vec![8], prompt.len() + 1, 1),
    ];
    for (i, s) in steps.iter().enumerate() {
        let want: Vec<f32> = reference.execute(s).unwrap().iter().copied().collect();
        let got = tp.execute(s).unwrap();
        let shape = [got.nrows(), got.ncols()];
        let got: Vec<f32> = got.iter().copied().collect();
        assert_close_shaped(
            &format!("{world} NCCL ranks, step {i}"),
            &got,
            &want,
            &shape,
            Tolerance::F32,
        );
    }
}

/// No ranks, a GPU named twice or one that is not there, and a machine without a driver or
/// NCCL: errors that say which, never a panic or a hang.
#[test]
fn a_group_that_cannot_be_made_is_an_error_saying_why() {
    assert!(nccl_group(&[]).is_err());
    let message = |ordinals: &[usize]| nccl_group(ordinals).err().unwrap().to_string();
    // SAFETY: each only tries to open the library by its candidate names.
    let (driver, nccl) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nccl::sys::is_culib_present(),
        )
    };
    match (driver, nccl) {
        (false, _) => assert!(
            message(&[0]).contains("no CUDA driver"),
            "{}",
            message(&[0])
        ),
        (true, false) => assert!(
            message(&[0]).contains("a link named libnccl.so"),
            "{}",
            message(&[0])
        ),
        (true, true) => {
            assert!(
                message(&[0, 0]).contains("named twice"),
                "{}",
                message(&[0, 0])
            );
            assert!(
                message(&[999]).contains("asks for GPU 999"),
                "{}",
                message(&[999])
            );
        }
    }
}
