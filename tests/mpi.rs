//! Tensor parallelism across processes (a kiln built with `--features mpi`, run by `cargo test
//! --features mpi --test mpi`): rank 0 is `kiln generate` / `kiln perplexity`, rank 1 is
//! `kiln tp-worker`, two processes under mpirun on this machine. They print exactly what two
//! threads print (the sums are taken in the same order), and what one rank prints.
//!
//! Skips when mpirun is not installed, unless `KILN_REQUIRE_MPI=1` (CI sets it).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ch01::fixtures_dir;

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

/// Whether mpirun is here; panics when it must be and is not.
fn have_mpirun() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found && std::env::var("KILN_REQUIRE_MPI").as_deref() == Ok("1") {
        panic!("KILN_REQUIRE_MPI=1 but mpirun is not installed (Debian: openmpi-bin)");
    }
    if !found {
        eprintln!("skipped: no mpirun");
    }
    found
}

/// `mpirun -n 1 kiln <rank0> : -n world-1 kiln tp-worker`, killed after two minutes.
fn group(world: usize, rank0: &[&str]) -> Output {
    group_with(world, rank0, &[])
}

/// [`group`] with `worker` after each `kiln tp-worker`.
fn group_with(world: usize, rank0: &[&str], worker: &[&str]) -> Output {
    let kiln = env!("CARGO_BIN_EXE_kiln");
    let workers = (world - 1).to_string();
    let mut child = Command::new("mpirun")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-n", "1", kiln])
        .args(rank0)
        .args([":", "-n", &workers, kiln, "tp-worker"])
        .args(worker)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mpirun");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait for mpirun").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("mpirun {rank0:?} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("mpirun's output")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 fixture path")
}

#[test]
fn two_processes_print_what_two_threads_and_one_rank_print() {
    if !have_mpirun() {
        return;
    }
    let prompts = fixtures_dir().join("prompts/demo.txt");
    let generate = [
        "generate",
        "--prompts-file",
        path(&prompts),
        "--max-tokens",
        "12",
        "--temperature",
        "0",
    ];
    let mpi = [
        "--tensor-parallel-size",
        "2",
        "--tensor-parallel-backend",
        "mpi",
    ];
    let one = stdout(&kiln(&generate));
    assert!(one.contains("=== [5]"), "{one}");
    assert_eq!(stdout(&group(2, &[&generate[..], &mpi].concat())), one);

    let hamlet = fixtures_dir().join("corpus/hamlet.txt");
    let ppl = ["perplexity", "--file", path(&hamlet), "--chunks", "2"];
    let threads = stdout(&kiln(&[&ppl[..], &mpi[..2]].concat()));
    let processes = stdout(&group(2, &[&ppl[..], &mpi].concat()));
    // "Final estimate: PPL = 74.8009 (2 chunks of 512 tokens, 510 tokens scored, 4.2 s)":
    // everything but the time.
    let line = |text: &str| {
        let line = text.lines().find(|l| l.contains("PPL = "))?;
        Some(line.split(" tokens scored").next()?.to_owned())
    };
    assert!(line(&threads).is_some(), "{threads}");
    assert_eq!(line(&processes), line(&threads));
}

#[test]
fn a_group_of_the_wrong_size_is_a_clear_error() {
    if !have_mpirun() {
        return;
    }
    // One process (no mpirun: MPI's singleton world) asked for two ranks.
    let output = kiln(&[
        "generate",
        "--prompt",
        "HAMLET.",
        "--tensor-parallel-size",
        "2",
        "--tensor-parallel-backend",
        "mpi",
    ]);
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("needs 2 processes"), "{err}");
    // A worker without a rank 0.
    let output = kiln(&["tp-worker"]);
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("rank 1.. of an MPI group"), "{err}");
}

/// A rank that fails never leaves the others waiting in a collective: it exits with its
/// error, without MPI's finalize (which waits for every process), and mpirun ends the job.
#[test]
fn a_failing_rank_ends_the_job_with_its_error() {
    if !have_mpirun() {
        return;
    }
    // Rank 0 asks for 3 ranks of a group of 2: its worker has loaded shard 1 of 2 and waits
    // for the plan that never comes.
    let generate = ["generate", "--prompt", "HAMLET.", "--max-tokens", "4"];
    let three = [
        "--tensor-parallel-size",
        "3",
        "--tensor-parallel-backend",
        "mpi",
    ];
    let output = group(2, &[&generate[..], &three].concat());
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(err.contains("needs 3 processes"), "{err}");
    // The worker runs another model: it refuses rank 0's plan, whose fingerprint is not its
    // shard's, before any step runs (WorkerError::OtherModel), and ends the job with that.
    let gqa = fixtures_dir().join("random/gqa");
    let two = [
        "--tensor-parallel-size",
        "2",
        "--tensor-parallel-backend",
        "mpi",
    ];
    let output = group_with(2, &[&generate[..], &two].concat(), &["--model", path(&gqa)]);
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        err.contains("tensor-parallel rank 1")
            && err.contains("this rank's model differs from rank 0's"),
        "{err}"
    );
}

/// `mpirun -n 2 kiln bench ch08-tp --communicator mpi --quick`: both processes time the
/// all-reduce together and rank 0 writes its table, a row per message size.
#[test]
fn the_mpi_all_reduce_benchmark_writes_its_table() {
    if !have_mpirun() {
        return;
    }
    let out = std::env::temp_dir().join(format!("kiln-mpi-bench-{}", std::process::id()));
    let output = Command::new("mpirun")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["--oversubscribe", "-n", "2", env!("CARGO_BIN_EXE_kiln")])
        .args([
            "bench",
            "ch08-tp",
            "--communicator",
            "mpi",
            "--quick",
            "--out",
            path(&out),
        ])
        .output()
        .expect("run mpirun");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let table = std::fs::read_to_string(out.join("tp-allreduce-mpi.md")).unwrap();
    // A header, its rule, and the five --quick sizes (256 B to 64 KiB).
    assert_eq!(
        table.lines().filter(|l| l.starts_with('|')).count(),
        2 + 5,
        "{table}"
    );
    assert!(table.contains("2 processes under mpirun"), "{table}");
    std::fs::remove_dir_all(&out).unwrap();
}
