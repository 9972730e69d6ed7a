//! A small graph IR over the ONNX protobuf: what the package builder writes and
//! what the validator and the native compiler read. Conversion from protobuf
//! checks what the IR relies on (known element types, tensor payload sizes,
//! attribute kinds) and reports the node or tensor at fault.

use crate::data::{Resolver, TensorData};
use crate::proto;
use crate::OnnxError;

/// ONNX `TensorProto.DataType` values the project understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    Float,
    Uint8,
    Int8,
    Int32,
    Int64,
    Bool,
    Float16,
    Double,
    Bfloat16,
}

impl DataType {
    pub fn from_onnx(code: i32) -> Option<Self> {
        Some(match code {
            1 => Self::Float,
            2 => Self::Uint8,
            3 => Self::Int8,
            6 => Self::Int32,
            7 => Self::Int64,
            9 => Self::Bool,
            10 => Self::Float16,
            11 => Self::Double,
            16 => Self::Bfloat16,
            _ => return None,
        })
    }

    pub fn onnx_code(self) -> i32 {
        match self {
            Self::Float => 1,
            Self::Uint8 => 2,
            Self::Int8 => 3,
            Self::Int32 => 6,
            Self::Int64 => 7,
            Self::Bool => 9,
            Self::Float16 => 10,
            Self::Double => 11,
            Self::Bfloat16 => 16,
        }
    }

    /// Bytes per element in little-endian raw storage.
    pub fn size_bytes(self) -> usize {
        match self {
            Self::Uint8 | Self::Int8 | Self::Bool => 1,
            Self::Float16 | Self::Bfloat16 => 2,
            Self::Float | Self::Int32 => 4,
            Self::Int64 | Self::Double => 8,
        }
    }

    /// The name used in manifests and messages (`f32`, `f16`, `i64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Float => "f32",
            Self::Uint8 => "u8",
            Self::Int8 => "i8",
            Self::Int32 => "i32",
            Self::Int64 => "i64",
            Self::Bool => "bool",
            Self::Float16 => "f16",
            Self::Double => "f64",
            Self::Bfloat16 => "bf16",
        }
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One dimension of a declared shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Fixed(i64),
    Symbolic(String),
    Unknown,
}

impl Dim {
    pub fn fixed(&self) -> Option<i64> {
        match self {
            Dim::Fixed(v) => Some(*v),
            _ => None,
        }
    }
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(v) => write!(f, "{v}"),
            Dim::Symbolic(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A graph input, output or annotated intermediate value.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    pub name: String,
    pub dtype: DataType,
    /// `None` when the model declares no shape at all (rank unknown).
    pub shape: Option<Vec<Dim>>,
}

impl ValueInfo {
    pub fn rank(&self) -> Option<usize> {
        self.shape.as_ref().map(Vec::len)
    }
}

/// A constant tensor, always held as little-endian raw bytes (inline, or
/// mapped from an external data file).
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub dtype: DataType,
    pub dims: Vec<i64>,
    pub raw: TensorData,
}

impl Tensor {
    pub fn element_count(&self) -> usize {
        self.dims.iter().map(|d| *d as usize).product()
    }

    pub fn from_f32(name: impl Into<String>, dims: Vec<i64>, values: &[f32]) -> Self {
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        Self { name: name.into(), dtype: DataType::Float, dims, raw }
    }

    pub fn from_f16(name: impl Into<String>, dims: Vec<i64>, values: &[half::f16]) -> Self {
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        Self { name: name.into(), dtype: DataType::Float16, dims, raw }
    }

    pub fn from_i64(name: impl Into<String>, dims: Vec<i64>, values: &[i64]) -> Self {
        let raw = values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into();
        Self { name: name.into(), dtype: DataType::Int64, dims, raw }
    }

    /// The values as `f32`, converting from f16/bf16/f64 where needed.
    pub fn to_f32(&self) -> Result<Vec<f32>, OnnxError> {
        let chunks = self.raw.chunks_exact(self.dtype.size_bytes());
        Ok(match self.dtype {
            DataType::Float => chunks.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DataType::Float16 => chunks.map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DataType::Bfloat16 => chunks.map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DataType::Double => {
                chunks.map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32).collect()
            }
            other => {
                return Err(OnnxError::Unsupported {
                    what: format!("tensor '{}' of type {other} read as floating point", self.name),
                })
            }
        })
    }

    /// The values as `i64`, widening narrower integer types.
    pub fn to_i64(&self) -> Result<Vec<i64>, OnnxError> {
        let chunks = self.raw.chunks_exact(self.dtype.size_bytes());
        Ok(match self.dtype {
            DataType::Int64 => {
                chunks.map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect()
            }
            DataType::Int32 => chunks.map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect(),
            DataType::Int8 => chunks.map(|c| c[0] as i8 as i64).collect(),
            DataType::Uint8 | DataType::Bool => chunks.map(|c| c[0] as i64).collect(),
            other => {
                return Err(OnnxError::Unsupported {
                    what: format!("tensor '{}' of type {other} read as integer", self.name),
                })
            }
        })
    }
}

/// Node attribute values.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Float(f32),
    Int(i64),
    String(String),
    Tensor(Tensor),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<String>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Attribute {
    pub name: String,
    pub value: AttrValue,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub name: String,
    pub op_type: String,
    /// Empty string means the default ONNX domain.
    pub domain: String,
    /// Empty string marks an omitted optional input.
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub attributes: Vec<Attribute>,
}

impl Node {
    pub fn attr(&self, name: &str) -> Option<&AttrValue> {
        self.attributes.iter().find(|a| a.name == name).map(|a| &a.value)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    pub inputs: Vec<ValueInfo>,
    pub outputs: Vec<ValueInfo>,
    pub value_infos: Vec<ValueInfo>,
    pub initializers: Vec<Tensor>,
}

impl Graph {
    pub fn input(&self, name: &str) -> Option<&ValueInfo> {
        self.inputs.iter().find(|v| v.name == name)
    }

    pub fn output(&self, name: &str) -> Option<&ValueInfo> {
        self.outputs.iter().find(|v| v.name == name)
    }

    pub fn initializer(&self, name: &str) -> Option<&Tensor> {
        self.initializers.iter().find(|t| t.name == name)
    }

    /// Inputs that are not also initializers: what a caller must feed.
    /// (The initializers' names are hashed once: looked up per input, a
    /// graph of 10^5 of each took 10^10 comparisons.)
    pub fn runtime_inputs(&self) -> impl Iterator<Item = &ValueInfo> {
        let initialized: std::collections::HashSet<&str> = self.initializers.iter().map(|t| t.name.as_str()).collect();
        self.inputs.iter().filter(move |i| !initialized.contains(i.name.as_str()))
    }

    /// Inputs by name (the first of each name, as [`Graph::input`] finds
    /// it), for code that looks up many: `input`, `output` and
    /// `initializer` scan the whole list each call.
    pub fn inputs_by_name(&self) -> std::collections::HashMap<&str, &ValueInfo> {
        first_by_name(&self.inputs, |v| &v.name)
    }

    /// Outputs by name, as [`Graph::inputs_by_name`].
    pub fn outputs_by_name(&self) -> std::collections::HashMap<&str, &ValueInfo> {
        first_by_name(&self.outputs, |v| &v.name)
    }

    /// Initializers by name, as [`Graph::inputs_by_name`].
    pub fn initializers_by_name(&self) -> std::collections::HashMap<&str, &Tensor> {
        first_by_name(&self.initializers, |t| &t.name)
    }

    /// Total number of scalar parameters held in initializers.
    pub fn parameter_count(&self) -> usize {
        self.initializers.iter().map(Tensor::element_count).sum()
    }
}

/// `values` by name, the first of each name kept.
fn first_by_name<'a, T>(
    values: &'a [T],
    name: impl Fn(&'a T) -> &'a String,
) -> std::collections::HashMap<&'a str, &'a T> {
    let mut map = std::collections::HashMap::with_capacity(values.len());
    for v in values {
        map.entry(name(v).as_str()).or_insert(v);
    }
    map
}

#[derive(Clone, Debug, PartialEq)]
pub struct OpsetImport {
    /// Empty string means the default ONNX domain.
    pub domain: String,
    pub version: i64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub ir_version: i64,
    pub opsets: Vec<OpsetImport>,
    pub producer_name: String,
    pub producer_version: String,
    pub graph: Graph,
}

impl Model {
    pub fn opset(&self, domain: &str) -> Option<i64> {
        let domain = if domain == "ai.onnx" { "" } else { domain };
        self.opsets.iter().find(|o| o.domain == domain).map(|o| o.version)
    }
}

// ---- protobuf -> IR ----

impl TryFrom<proto::ModelProto> for Model {
    type Error = OnnxError;

    /// Without a directory: external data is an error (use
    /// [`Model::from_proto_in`]).
    fn try_from(m: proto::ModelProto) -> Result<Self, OnnxError> {
        Model::from_proto_in(m, None)
    }
}

impl Model {
    /// Converts `m`, resolving external data with `resolver` (relative to
    /// the model's directory).
    pub fn from_proto_in(m: proto::ModelProto, mut resolver: Option<&mut Resolver>) -> Result<Self, OnnxError> {
        let graph = m
            .graph
            .ok_or_else(|| OnnxError::Invalid { location: "model".into(), reason: "the model has no graph".into() })?;
        Ok(Model {
            ir_version: m.ir_version,
            opsets: m
                .opset_import
                .into_iter()
                .map(|o| OpsetImport {
                    domain: if o.domain == "ai.onnx" { String::new() } else { o.domain },
                    version: o.version,
                })
                .collect(),
            producer_name: m.producer_name,
            producer_version: m.producer_version,
            graph: graph_from_proto(graph, &mut resolver)?,
        })
    }
}

pub(crate) type Ctx<'a, 'r> = &'a mut Option<&'r mut Resolver>;

fn graph_from_proto(g: proto::GraphProto, ctx: Ctx) -> Result<Graph, OnnxError> {
    if let Some(sparse) = g.sparse_initializer.first() {
        let name = sparse.values.as_ref().map_or("", |v| v.name.as_str());
        return Err(OnnxError::Unsupported {
            what: format!(
                "graph `{}`: sparse initializer `{name}` ({} in all): sparse tensors are not supported; store it dense",
                g.name,
                g.sparse_initializer.len()
            ),
        });
    }
    let value_infos = |list: Vec<proto::ValueInfoProto>| -> Result<Vec<ValueInfo>, OnnxError> {
        list.into_iter().map(value_info_from_proto).collect()
    };
    Ok(Graph {
        nodes: g.node.into_iter().enumerate().map(|(i, n)| node_from_proto(i, n, ctx)).collect::<Result<_, _>>()?,
        inputs: value_infos(g.input)?,
        outputs: value_infos(g.output)?,
        value_infos: value_infos(g.value_info)?,
        initializers: g.initializer.into_iter().map(|t| tensor_from_proto(t, ctx)).collect::<Result<_, _>>()?,
        name: g.name,
    })
}

fn value_info_from_proto(v: proto::ValueInfoProto) -> Result<ValueInfo, OnnxError> {
    let location = format!("value '{}'", v.name);
    let Some(proto::type_proto::Value::TensorType(t)) = v.r#type.and_then(|t| t.value) else {
        return Err(OnnxError::Invalid { location, reason: "declares no tensor type".into() });
    };
    let dtype = DataType::from_onnx(t.elem_type)
        .ok_or_else(|| OnnxError::Unsupported { what: format!("{location}: element type {}", t.elem_type) })?;
    let shape = t.shape.map(|s| {
        s.dim
            .into_iter()
            .map(|d| match d.value {
                Some(proto::tensor_shape_proto::dimension::Value::DimValue(v)) => Dim::Fixed(v),
                Some(proto::tensor_shape_proto::dimension::Value::DimParam(p)) => Dim::Symbolic(p),
                None => Dim::Unknown,
            })
            .collect()
    });
    Ok(ValueInfo { name: v.name, dtype, shape })
}

/// The most elements an initializer's nonzero dims may span (2^32: 16 GiB
/// of f32, as native-cpu's kernels bound any tensor they make).
pub const MAX_TENSOR_SPAN: u64 = 1 << 32;

pub(crate) fn tensor_from_proto(t: proto::TensorProto, ctx: Ctx) -> Result<Tensor, OnnxError> {
    let location = format!("initializer '{}'", t.name);
    let dtype = DataType::from_onnx(t.data_type)
        .ok_or_else(|| OnnxError::Unsupported { what: format!("{location}: element type {}", t.data_type) })?;
    if let Some(d) = t.dims.iter().find(|d| **d < 0) {
        return Err(OnnxError::Invalid { location, reason: format!("negative dimension {d}") });
    }
    // An empty tensor holds nothing whatever its other dims, but kernels
    // size work and index buffers by its axes: no real initializer spans
    // more than this even with a zero dim.
    let span = t.dims.iter().filter(|d| **d > 0).try_fold(1u64, |acc, d| acc.checked_mul(*d as u64));
    if span.is_none_or(|n| n > MAX_TENSOR_SPAN) {
        return Err(OnnxError::Invalid {
            location,
            reason: format!("dims {:?} span more than {MAX_TENSOR_SPAN} elements (zero dims aside)", t.dims),
        });
    }
    let count = t
        .dims
        .iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d as usize))
        .ok_or_else(|| OnnxError::Invalid { location: location.clone(), reason: "element count overflows".into() })?;
    let expected = count.checked_mul(dtype.size_bytes());
    if t.data_location == proto::data_location::EXTERNAL {
        let Some(resolver) = ctx.as_deref_mut() else {
            return Err(OnnxError::Unsupported {
                what: format!("{location}: external data needs the model's directory (read the model from its file)"),
            });
        };
        let expected = expected.ok_or_else(|| OnnxError::Invalid { location, reason: "too many bytes".into() })?;
        let raw = resolver.resolve(&t.name, &t.external_data, expected)?;
        return Ok(Tensor { name: t.name, dtype, dims: t.dims, raw });
    }
    let raw = if !t.raw_data.is_empty() { t.raw_data } else { typed_payload_to_raw(dtype, &t) };
    if expected != Some(raw.len()) {
        return Err(OnnxError::Invalid {
            location,
            reason: format!(
                "dims {:?} of {dtype} need {} bytes but the payload has {}",
                t.dims,
                expected.map_or("too many".to_string(), |e| e.to_string()),
                raw.len()
            ),
        });
    }
    Ok(Tensor { name: t.name, dtype, dims: t.dims, raw: raw.into() })
}

/// ONNX stores small tensors in typed repeated fields instead of `raw_data`;
/// f16/bf16/bool/int8 values travel inside `int32_data`.
fn typed_payload_to_raw(dtype: DataType, t: &proto::TensorProto) -> Vec<u8> {
    match dtype {
        DataType::Float => t.float_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DataType::Double => t.double_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DataType::Int64 => t.int64_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DataType::Int32 => t.int32_data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DataType::Float16 | DataType::Bfloat16 => t.int32_data.iter().flat_map(|v| (*v as u16).to_le_bytes()).collect(),
        DataType::Uint8 | DataType::Int8 | DataType::Bool => t.int32_data.iter().map(|v| *v as u8).collect(),
    }
}

fn node_from_proto(index: usize, n: proto::NodeProto, ctx: Ctx) -> Result<Node, OnnxError> {
    let label = if n.name.is_empty() { format!("#{index} ({})", n.op_type) } else { format!("'{}'", n.name) };
    let attributes = n.attribute.into_iter().map(|a| attribute_from_proto(&label, a, ctx)).collect::<Result<_, _>>()?;
    Ok(Node {
        name: n.name,
        op_type: n.op_type,
        domain: if n.domain == "ai.onnx" { String::new() } else { n.domain },
        inputs: n.input,
        outputs: n.output,
        attributes,
    })
}

fn attribute_from_proto(node: &str, a: proto::AttributeProto, ctx: Ctx) -> Result<Attribute, OnnxError> {
    use proto::attribute_type as ty;
    let utf8 = |bytes: Vec<u8>| {
        String::from_utf8(bytes).map_err(|_| OnnxError::Invalid {
            location: format!("node {node} attribute '{}'", a.name),
            reason: "string is not UTF-8".into(),
        })
    };
    let value = match a.r#type {
        ty::FLOAT => AttrValue::Float(a.f),
        ty::INT => AttrValue::Int(a.i),
        ty::STRING => AttrValue::String(utf8(a.s.clone())?),
        ty::TENSOR => match a.t.clone() {
            Some(t) => AttrValue::Tensor(tensor_from_proto(t, ctx)?),
            None => {
                return Err(OnnxError::Invalid {
                    location: format!("node {node} attribute '{}'", a.name),
                    reason: "TENSOR attribute without a tensor".into(),
                })
            }
        },
        ty::FLOATS => AttrValue::Floats(a.floats.clone()),
        ty::INTS => AttrValue::Ints(a.ints.clone()),
        ty::STRINGS => AttrValue::Strings(a.strings.clone().into_iter().map(utf8).collect::<Result<_, _>>()?),
        other => {
            return Err(OnnxError::Unsupported {
                what: format!("node {node} attribute '{}' of attribute type {other}", a.name),
            })
        }
    };
    Ok(Attribute { name: a.name, value })
}

// ---- IR -> protobuf ----

impl From<&Model> for proto::ModelProto {
    fn from(m: &Model) -> Self {
        proto::ModelProto {
            ir_version: m.ir_version,
            opset_import: m
                .opsets
                .iter()
                .map(|o| proto::OperatorSetIdProto { domain: o.domain.clone(), version: o.version })
                .collect(),
            producer_name: m.producer_name.clone(),
            producer_version: m.producer_version.clone(),
            graph: Some(graph_to_proto(&m.graph)),
            ..Default::default()
        }
    }
}

fn graph_to_proto(g: &Graph) -> proto::GraphProto {
    proto::GraphProto {
        node: g.nodes.iter().map(node_to_proto).collect(),
        name: g.name.clone(),
        initializer: g.initializers.iter().map(tensor_to_proto).collect(),
        input: g.inputs.iter().map(value_info_to_proto).collect(),
        output: g.outputs.iter().map(value_info_to_proto).collect(),
        value_info: g.value_infos.iter().map(value_info_to_proto).collect(),
        ..Default::default()
    }
}

fn value_info_to_proto(v: &ValueInfo) -> proto::ValueInfoProto {
    use proto::tensor_shape_proto::{dimension, Dimension};
    let shape = v.shape.as_ref().map(|dims| proto::TensorShapeProto {
        dim: dims
            .iter()
            .map(|d| Dimension {
                value: match d {
                    Dim::Fixed(v) => Some(dimension::Value::DimValue(*v)),
                    Dim::Symbolic(s) => Some(dimension::Value::DimParam(s.clone())),
                    Dim::Unknown => None,
                },
                denotation: String::new(),
            })
            .collect(),
    });
    proto::ValueInfoProto {
        name: v.name.clone(),
        r#type: Some(proto::TypeProto {
            value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
                elem_type: v.dtype.onnx_code(),
                shape,
            })),
            denotation: String::new(),
        }),
        doc_string: String::new(),
    }
}

fn tensor_to_proto(t: &Tensor) -> proto::TensorProto {
    proto::TensorProto {
        dims: t.dims.clone(),
        data_type: t.dtype.onnx_code(),
        name: t.name.clone(),
        raw_data: t.raw.to_vec(),
        ..Default::default()
    }
}

fn node_to_proto(n: &Node) -> proto::NodeProto {
    use proto::attribute_type as ty;
    proto::NodeProto {
        input: n.inputs.clone(),
        output: n.outputs.clone(),
        name: n.name.clone(),
        op_type: n.op_type.clone(),
        domain: n.domain.clone(),
        attribute: n
            .attributes
            .iter()
            .map(|a| {
                let mut p = proto::AttributeProto { name: a.name.clone(), ..Default::default() };
                match &a.value {
                    AttrValue::Float(f) => (p.r#type, p.f) = (ty::FLOAT, *f),
                    AttrValue::Int(i) => (p.r#type, p.i) = (ty::INT, *i),
                    AttrValue::String(s) => (p.r#type, p.s) = (ty::STRING, s.clone().into_bytes()),
                    AttrValue::Tensor(t) => (p.r#type, p.t) = (ty::TENSOR, Some(tensor_to_proto(t))),
                    AttrValue::Floats(v) => (p.r#type, p.floats) = (ty::FLOATS, v.clone()),
                    AttrValue::Ints(v) => (p.r#type, p.ints) = (ty::INTS, v.clone()),
                    AttrValue::Strings(v) => {
                        (p.r#type, p.strings) = (ty::STRINGS, v.iter().map(|s| s.clone().into_bytes()).collect())
                    }
                }
                p
            })
            .collect(),
        doc_string: String::new(),
    }
}
