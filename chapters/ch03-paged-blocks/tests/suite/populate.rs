//! `KvPool::populate`: every page of a fresh pool is resident afterwards (where the system
//! offers it), none before, and no element changes.

use ch01::{LlamaConfig, fixtures_dir};
use ch03_paged_blocks::KvPool;
use ndarray::Array1;

/// How many of the pages that hold `buffer` are resident.
#[cfg(target_os = "linux")]
fn resident_pages(buffer: &[f32]) -> (usize, usize) {
    let page = 4096;
    let start = buffer.as_ptr() as usize;
    let first = start / page * page;
    let len = start + size_of_val(buffer) - first;
    let mut flags = vec![0u8; len.div_ceil(page)];
    // SAFETY: `first..first + len` covers `buffer`'s pages, mapped by this process; `flags` holds
    // one byte per page, which is what mincore writes.
    let rc = unsafe { libc::mincore(first as *mut libc::c_void, len, flags.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore");
    (flags.iter().filter(|f| *f & 1 == 1).count(), flags.len())
}

#[test]
fn populate_backs_every_page_and_changes_no_element() {
    let config = LlamaConfig::from_dir(&fixtures_dir().join("shakespeare-small")).unwrap();
    // 2 MiB of keys per layer: large enough that the allocator maps fresh pages.
    let block_size = 16;
    let kv_dim = config.num_key_value_heads * config.head_dim;
    let blocks = (2 << 20) / (block_size * kv_dim * size_of::<f32>());
    let mut pool = KvPool::<f32>::new(&config, block_size, blocks).unwrap();
    let row = Array1::from_iter((0..kv_dim).map(|i| i as f32 + 0.5));
    pool.write(0, 3, row.view(), row.view());
    #[cfg(target_os = "linux")]
    {
        let (resident, pages) = resident_pages(pool.layer_kv(1).0);
        assert!(
            resident < pages / 2,
            "a fresh pool is lazy: {resident} of {pages} resident"
        );
    }
    let populated = pool.populate();
    let (keys, values) = pool.layer_kv(0);
    assert_eq!(&keys[3 * kv_dim..4 * kv_dim], row.as_slice().unwrap());
    assert_eq!(&values[3 * kv_dim..4 * kv_dim], row.as_slice().unwrap());
    assert!(
        keys[..3 * kv_dim]
            .iter()
            .chain(&keys[4 * kv_dim..])
            .all(|&x| x == 0.0)
    );
    // Linux 5.14 and later back the pages at once (MADV_POPULATE_WRITE); elsewhere populate
    // says it did not, and the pages fault lazily as before.
    #[cfg(target_os = "linux")]
    {
        assert!(
            populated,
            "populate refused on Linux (a kernel before 5.14?)"
        );
        for layer in 0..config.num_hidden_layers {
            for buffer in <[&[f32]; 2]>::from(pool.layer_kv(layer)) {
                let (resident, pages) = resident_pages(buffer);
                assert_eq!(resident, pages, "layer {layer}: every page resident");
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    assert!(!populated);
}
