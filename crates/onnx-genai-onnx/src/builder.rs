//! A builder for graphs: fresh, readable value names, constants, opset imports.

use crate::ir::{AttrValue, Attribute, DataType, Dim, Graph, Model, Node, OpsetImport, Tensor, ValueInfo};

pub fn attr_int(name: &str, v: i64) -> Attribute {
    Attribute { name: name.into(), value: AttrValue::Int(v) }
}

pub fn attr_float(name: &str, v: f32) -> Attribute {
    Attribute { name: name.into(), value: AttrValue::Float(v) }
}

pub fn attr_ints(name: &str, v: &[i64]) -> Attribute {
    Attribute { name: name.into(), value: AttrValue::Ints(v.to_vec()) }
}

pub fn attr_string(name: &str, v: &str) -> Attribute {
    Attribute { name: name.into(), value: AttrValue::String(v.into()) }
}

pub fn attr_tensor(name: &str, t: Tensor) -> Attribute {
    Attribute { name: name.into(), value: AttrValue::Tensor(t) }
}

/// Builds one graph. Generated value names are `<scope>/<OpType>_<n>` so a
/// compile or runtime error that names a node points at a place a person can
/// find in the model.
pub struct GraphBuilder {
    graph: Graph,
    opsets: Vec<OpsetImport>,
    scope: String,
    counter: usize,
}

impl GraphBuilder {
    pub fn new(name: &str, default_opset: i64) -> Self {
        Self {
            graph: Graph {
                name: name.into(),
                nodes: Vec::new(),
                inputs: Vec::new(),
                outputs: Vec::new(),
                value_infos: Vec::new(),
                initializers: Vec::new(),
            },
            opsets: vec![OpsetImport { domain: String::new(), version: default_opset }],
            scope: String::new(),
            counter: 0,
        }
    }

    /// Declares an extra operator-set import (e.g. `com.microsoft`, 1).
    pub fn opset(&mut self, domain: &str, version: i64) {
        match self.opsets.iter_mut().find(|o| o.domain == domain) {
            Some(o) => o.version = version,
            None => self.opsets.push(OpsetImport { domain: domain.into(), version }),
        }
    }

    /// Sets the prefix of generated names, e.g. `/layers.0/attn`.
    pub fn set_scope(&mut self, scope: &str) {
        self.scope = scope.into();
    }

    pub fn input(&mut self, name: &str, dtype: DataType, shape: Vec<Dim>) {
        self.graph.inputs.push(ValueInfo { name: name.into(), dtype, shape: Some(shape) });
    }

    pub fn output(&mut self, name: &str, dtype: DataType, shape: Vec<Dim>) {
        self.graph.outputs.push(ValueInfo { name: name.into(), dtype, shape: Some(shape) });
    }

    /// Adds a named initializer and returns its name.
    pub fn initializer(&mut self, tensor: Tensor) -> String {
        let name = tensor.name.clone();
        self.graph.initializers.push(tensor);
        name
    }

    /// A fresh value name in the current scope.
    pub fn fresh(&mut self, stem: &str) -> String {
        self.counter += 1;
        format!("{}/{}_{}", self.scope, stem, self.counter)
    }

    /// A 1-D int64 constant (shapes, axes, indices).
    pub fn const_i64(&mut self, values: &[i64]) -> String {
        let name = self.fresh("Constant");
        self.initializer(Tensor::from_i64(name, vec![values.len() as i64], values))
    }

    /// A scalar int64 constant.
    pub fn scalar_i64(&mut self, value: i64) -> String {
        let name = self.fresh("Constant");
        self.initializer(Tensor::from_i64(name, vec![], &[value]))
    }

    /// A scalar f32 constant.
    pub fn scalar_f32(&mut self, value: f32) -> String {
        let name = self.fresh("Constant");
        self.initializer(Tensor::from_f32(name, vec![], &[value]))
    }

    /// Adds a node with one output and returns the output's name.
    pub fn op(&mut self, op_type: &str, inputs: &[&str]) -> String {
        self.op_with(op_type, inputs, Vec::new())
    }

    /// Adds a node with attributes and one output; returns the output's name.
    pub fn op_with(&mut self, op_type: &str, inputs: &[&str], attributes: Vec<Attribute>) -> String {
        let out = self.fresh(op_type);
        self.node_in("", op_type, inputs, &[&out], attributes);
        out
    }

    /// Adds a node whose output names are given (graph outputs, KV presents).
    pub fn op_into(&mut self, op_type: &str, inputs: &[&str], outputs: &[&str], attributes: Vec<Attribute>) {
        self.node_in("", op_type, inputs, outputs, attributes);
    }

    /// Adds a node in a non-default domain with given outputs.
    pub fn node_in(
        &mut self,
        domain: &str,
        op_type: &str,
        inputs: &[&str],
        outputs: &[&str],
        attributes: Vec<Attribute>,
    ) {
        let name = match outputs.first() {
            Some(first) if first.starts_with(&self.scope) && !self.scope.is_empty() => first.to_string(),
            _ => self.fresh(&format!("{op_type}_node")),
        };
        self.graph.nodes.push(Node {
            name,
            op_type: op_type.into(),
            domain: domain.into(),
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
            outputs: outputs.iter().map(|s| s.to_string()).collect(),
            attributes,
        });
    }

    /// Whether a node already produces `name`.
    pub fn has_value(&self, name: &str) -> bool {
        self.graph.nodes.iter().any(|n| n.outputs.iter().any(|o| o == name))
    }

    pub fn finish(self, ir_version: i64, producer_version: &str) -> Model {
        Model {
            ir_version,
            opsets: self.opsets,
            producer_name: "onnx-genai".into(),
            producer_version: producer_version.into(),
            graph: self.graph,
        }
    }
}
