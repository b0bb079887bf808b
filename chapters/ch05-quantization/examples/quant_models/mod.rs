//! What chapter 5's projection examples share: the models they stream, each named.

use ch01::Llama;
use ch05_quantization::{GgmlType, QuantLoader, load_gguf};

/// SmolLM2 (the HF directory `dir`) quantized on load to Q8_0, Q4_0 and Q4_K (whose 576-wide
/// layers fall back to Q5_0: only down_proj is Q4_K), then, given its path, a GGUF file as
/// stored, named by its file name.
pub fn load(
    dir: &str,
    gguf: Option<&str>,
) -> Result<Vec<(String, Llama)>, Box<dyn std::error::Error>> {
    let mut models = Vec::new();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K] {
        let model = Llama::load_with(dir.as_ref(), &QuantLoader::to(ty)?)?;
        models.push((ty.to_string(), model));
    }
    if let Some(gguf) = gguf {
        let path = std::path::Path::new(gguf);
        let name = path
            .file_name()
            .map_or(gguf.to_string(), |n| n.to_string_lossy().into_owned());
        models.push((name, load_gguf(path, &QuantLoader::native())?.model));
    }
    Ok(models)
}
