//! `quantization_config` in config.json, as GPTQ and AWQ checkpoints write it:
//!
//! ```json
//! {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true,
//!  "damp_percent": 0.01, "checkpoint_format": "gptq"}
//! {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": true, "version": "gemm"}
//! ```
//!
//! kiln reads 4-bit only, GPTQ's original (`gptq`, "v1") zero-point convention and AWQ's GEMM
//! layout with zero points; anything else is [`HfQuantError::Unsupported`], naming the field.

use serde_json::{Value, json};

use super::HfQuantError;

/// The two layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMethod {
    Gptq,
    Awq,
}

/// A checked `quantization_config`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HfQuantConfig {
    pub method: QuantMethod,
    /// Input columns per group; `None` is `-1` in the file, one group per row.
    pub group_size: Option<usize>,
    /// GPTQ's `desc_act` (act-order; `g_idx` then permutes the groups). AWQ: false.
    pub desc_act: bool,
    /// GPTQ's `sym`. AWQ always has zero points (`sym` false).
    pub sym: bool,
    /// GPTQ's `damp_percent` as written (informative only).
    pub damp_percent: f64,
}

/// The largest group size accepted from a file (a bound, not a limit of the formats).
const MAX_GROUP: usize = 1 << 20;

impl HfQuantConfig {
    /// The `quantization_config` of a parsed config.json: `Ok(None)` when there is none.
    pub fn from_config_json(config: &Value) -> Result<Option<Self>, HfQuantError> {
        let Some(q) = config.get("quantization_config") else {
            return Ok(None);
        };
        let bad = |m: String| HfQuantError::Config(m);
        let q = q
            .as_object()
            .ok_or_else(|| bad("is not an object".into()))?;
        let method = match q.get("quant_method").and_then(Value::as_str) {
            Some(m) if m.eq_ignore_ascii_case("gptq") => QuantMethod::Gptq,
            Some(m) if m.eq_ignore_ascii_case("awq") => QuantMethod::Awq,
            Some(m) => {
                return Err(HfQuantError::Unsupported(format!(
                    "quant_method {m:?} (kiln reads \"gptq\" and \"awq\" here)"
                )));
            }
            None => return Err(bad("`quant_method` is missing or not a string".into())),
        };
        let int = |keys: &[&str]| -> Result<Option<i64>, HfQuantError> {
            for k in keys {
                if let Some(v) = q.get(*k) {
                    return v
                        .as_i64()
                        .map(Some)
                        .ok_or_else(|| bad(format!("`{k}` is not an integer: {v}")));
                }
            }
            Ok(None)
        };
        let boolean = |key: &str, default: bool| -> Result<bool, HfQuantError> {
            match q.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| bad(format!("`{key}` is not a boolean: {v}"))),
            }
        };
        let bits = int(&["bits", "w_bit"])?.ok_or_else(|| bad("`bits` is missing".into()))?;
        if bits != 4 {
            return Err(HfQuantError::Unsupported(format!(
                "bits = {bits} (kiln reads 4-bit checkpoints)"
            )));
        }
        let group_size = match int(&["group_size", "q_group_size"])? {
            None => return Err(bad("`group_size` is missing".into())),
            Some(-1) => None,
            Some(g) if g >= 1 && g as usize <= MAX_GROUP => Some(g as usize),
            Some(g) => {
                return Err(bad(format!(
                    "group_size {g} is not -1 nor in 1..={MAX_GROUP}"
                )));
            }
        };
        let config = match method {
            QuantMethod::Gptq => {
                if let Some(format) = q.get("checkpoint_format").and_then(Value::as_str)
                    && !format.eq_ignore_ascii_case("gptq")
                {
                    return Err(HfQuantError::Unsupported(format!(
                        "checkpoint_format {format:?} (kiln reads \"gptq\")"
                    )));
                }
                HfQuantConfig {
                    method,
                    group_size,
                    desc_act: boolean("desc_act", false)?,
                    sym: boolean("sym", true)?,
                    damp_percent: q
                        .get("damp_percent")
                        .and_then(Value::as_f64)
                        .unwrap_or(0.01),
                }
            }
            QuantMethod::Awq => {
                let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
                if !version.eq_ignore_ascii_case("gemm") {
                    return Err(HfQuantError::Unsupported(format!(
                        "AWQ version {version:?} (kiln reads \"gemm\")"
                    )));
                }
                if !boolean("zero_point", true)? {
                    return Err(HfQuantError::Unsupported("AWQ without zero points".into()));
                }
                if group_size.is_none() {
                    return Err(HfQuantError::Unsupported("AWQ with group_size -1".into()));
                }
                HfQuantConfig {
                    method,
                    group_size,
                    desc_act: false,
                    sym: false,
                    damp_percent: 0.0,
                }
            }
        };
        Ok(Some(config))
    }

    /// The `quantization_config` object this configuration writes.
    pub fn to_json(&self) -> Value {
        let group = self.group_size.map_or(-1, |g| g as i64);
        match self.method {
            QuantMethod::Gptq => json!({
                "quant_method": "gptq",
                "bits": 4,
                "group_size": group,
                "desc_act": self.desc_act,
                "sym": self.sym,
                "damp_percent": self.damp_percent,
                "true_sequential": true,
                "static_groups": false,
                "checkpoint_format": "gptq",
            }),
            QuantMethod::Awq => json!({
                "quant_method": "awq",
                "bits": 4,
                "group_size": group,
                "zero_point": true,
                "version": "gemm",
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_config_reads_back() {
        for config in [
            HfQuantConfig {
                method: QuantMethod::Gptq,
                group_size: Some(128),
                desc_act: true,
                sym: true,
                damp_percent: 0.01,
            },
            HfQuantConfig {
                method: QuantMethod::Awq,
                group_size: Some(64),
                desc_act: false,
                sym: false,
                damp_percent: 0.0,
            },
        ] {
            let json = json!({ "quantization_config": config.to_json() });
            assert_eq!(HfQuantConfig::from_config_json(&json), Ok(Some(config)));
        }
        assert_eq!(HfQuantConfig::from_config_json(&json!({})), Ok(None));
    }
}
