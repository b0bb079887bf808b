//! GGUF metadata values: the thirteen value types a key can hold.
//!
//! ```text
//! id  type     bytes in the file
//!  0  u8       1          7  bool     1 (0 or 1)
//!  1  i8       1          8  string   u64 length, then that many UTF-8 bytes
//!  2  u16      2          9  array    u32 element type, u64 count, then the elements
//!  3  i16      2         10  u64      8
//!  4  u32      4         11  i64      8
//!  5  i32      4         12  f64      8
//!  6  f32      4
//! ```
//!
//! Every number is little-endian. An array holds elements of one type; an array of arrays is
//! allowed (each inner array carries its own element type).

/// A metadata value type, numbered as in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    /// Every value type, in id order.
    pub const ALL: [GgufValueType; 13] = [
        GgufValueType::U8,
        GgufValueType::I8,
        GgufValueType::U16,
        GgufValueType::I16,
        GgufValueType::U32,
        GgufValueType::I32,
        GgufValueType::F32,
        GgufValueType::Bool,
        GgufValueType::String,
        GgufValueType::Array,
        GgufValueType::U64,
        GgufValueType::I64,
        GgufValueType::F64,
    ];

    /// The type with file id `id`, if there is one.
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        GgufValueType::ALL.into_iter().find(|t| t.id() == id)
    }

    pub const fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes in the file (a string's length field, an
    /// array's type and count): the bound that lets the reader refuse a count before allocating.
    pub const fn min_bytes(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

/// An array value: its element type and elements. Invariant (checked by [`GgufArray::new`]):
/// every element has type `elem`.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufArray {
    elem: GgufValueType,
    values: Vec<GgufValue>,
}

impl GgufArray {
    /// An array of `values`, all of type `elem`; `None` when one is of another type.
    pub fn new(elem: GgufValueType, values: Vec<GgufValue>) -> Option<GgufArray> {
        values
            .iter()
            .all(|v| v.value_type() == elem)
            .then_some(GgufArray { elem, values })
    }

    /// For callers that built every element as `elem` themselves (the reader).
    pub(crate) fn of_type(elem: GgufValueType, values: Vec<GgufValue>) -> GgufArray {
        debug_assert!(values.iter().all(|v| v.value_type() == elem));
        GgufArray { elem, values }
    }

    pub fn elem(&self) -> GgufValueType {
        self.elem
    }

    pub fn values(&self) -> &[GgufValue] {
        &self.values
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        use GgufValue as V;
        use GgufValueType as T;
        match self {
            V::U8(_) => T::U8,
            V::I8(_) => T::I8,
            V::U16(_) => T::U16,
            V::I16(_) => T::I16,
            V::U32(_) => T::U32,
            V::I32(_) => T::I32,
            V::U64(_) => T::U64,
            V::I64(_) => T::I64,
            V::F32(_) => T::F32,
            V::F64(_) => T::F64,
            V::Bool(_) => T::Bool,
            V::String(_) => T::String,
            V::Array(_) => T::Array,
        }
    }

    /// An array of strings.
    pub fn strings<S: Into<String>>(values: impl IntoIterator<Item = S>) -> GgufValue {
        GgufValue::Array(GgufArray {
            elem: GgufValueType::String,
            values: values
                .into_iter()
                .map(|s| GgufValue::String(s.into()))
                .collect(),
        })
    }

    /// An array of numbers or bools, all of the type `T` converts to (`Vec<u32>`, `Vec<f32>`...).
    pub fn array<T: Into<GgufValue> + Scalar>(values: impl IntoIterator<Item = T>) -> GgufValue {
        GgufValue::Array(GgufArray {
            elem: T::TYPE,
            values: values.into_iter().map(Into::into).collect(),
        })
    }

    /// Any integer value, if it is one and fits `u64` (negative values do not).
    pub fn as_u64(&self) -> Option<u64> {
        use GgufValue as V;
        match *self {
            V::U8(v) => Some(v.into()),
            V::U16(v) => Some(v.into()),
            V::U32(v) => Some(v.into()),
            V::U64(v) => Some(v),
            V::I8(v) => u64::try_from(v).ok(),
            V::I16(v) => u64::try_from(v).ok(),
            V::I32(v) => u64::try_from(v).ok(),
            V::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value, if it is one and fits `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        use GgufValue as V;
        match *self {
            V::I8(v) => Some(v.into()),
            V::I16(v) => Some(v.into()),
            V::I32(v) => Some(v.into()),
            V::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// An f32 or f64 value, widened to f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// A short description for error messages: the type, and the length of an array.
    pub fn describe(&self) -> String {
        match self {
            GgufValue::Array(a) => format!("array of {} {:?}", a.len(), a.elem()),
            other => format!("{:?}", other.value_type()),
        }
    }
}

/// The value types that are one plain number or bool (everything but string and array).
pub trait Scalar {
    const TYPE: GgufValueType;
}

macro_rules! scalar {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl From<$t> for GgufValue {
            fn from(v: $t) -> GgufValue {
                GgufValue::$variant(v)
            }
        }
        impl Scalar for $t {
            const TYPE: GgufValueType = GgufValueType::$variant;
        }
    )*};
}

scalar!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, bool => Bool);

impl From<&str> for GgufValue {
    fn from(v: &str) -> GgufValue {
        GgufValue::String(v.to_string())
    }
}

impl From<String> for GgufValue {
    fn from(v: String) -> GgufValue {
        GgufValue::String(v)
    }
}

impl From<GgufArray> for GgufValue {
    fn from(v: GgufArray) -> GgufValue {
        GgufValue::Array(v)
    }
}
