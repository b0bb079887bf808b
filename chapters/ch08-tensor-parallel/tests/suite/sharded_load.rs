//! A rank decodes only its part of the embedding table: loading shard r of N asks the source
//! for the rank's `vocab / N` rows of `model.embed_tokens.weight`, never the whole table, and
//! those rows equal the whole model's.

use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;

use ch01::linear::DenseLoader;
use ch01::{Llama, LlamaConfig, RawTensor, TensorParallel, WeightSource, Weights, fixtures_dir};
use ndarray::{Array2, s};

const EMBED: &str = "model.embed_tokens.weight";

/// The checkpoint's tensors, with every block of the embedding table asked for recorded.
struct Recording {
    inner: Weights,
    embed_rows: Mutex<Vec<Range<usize>>>,
}

impl WeightSource for Recording {
    fn location(&self) -> &Path {
        self.inner.location()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        self.inner.tensor(name)
    }

    fn matrix_block(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> ch01::Result<Array2<f32>> {
        if name == EMBED {
            self.embed_rows.lock().unwrap().push(rows.clone());
        }
        self.inner.matrix_block(name, shape, rows, cols)
    }
}

#[test]
fn each_rank_decodes_only_its_rows_of_the_embedding() {
    let dir = fixtures_dir().join("shakespeare-small");
    let config = LlamaConfig::from_dir(&dir).unwrap();
    let whole = Llama::load(&dir).unwrap();
    let vocab = config.vocab_size;
    for world in [2, 4] {
        for rank in 0..world {
            let source = Recording {
                inner: Weights::open(&dir).unwrap(),
                embed_rows: Mutex::new(Vec::new()),
            };
            let shard = TensorParallel { rank, world };
            let model = Llama::from_source(config.clone(), &source, &DenseLoader, shard).unwrap();
            let mine = shard.vocab_range(vocab);
            assert_eq!(mine.len(), vocab / world);
            let asked = source.embed_rows.into_inner().unwrap();
            assert!(!asked.is_empty(), "world {world} rank {rank}");
            assert!(
                asked.iter().all(|rows| *rows == mine),
                "world {world} rank {rank}: asked for rows {asked:?}, holds {mine:?}"
            );
            assert_eq!(
                model.embed_tokens,
                whole.embed_tokens.slice(s![mine, ..]),
                "world {world} rank {rank}"
            );
        }
    }
}
