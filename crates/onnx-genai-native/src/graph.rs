//! The compiler's working graph: values with inferred dtype/dims and
//! optional constant data, and lowered nodes kept in topological order.
//! Passes remove nodes (`None`) and put fused nodes where the last node of
//! their pattern was, which keeps the order valid (stacked sibling
//! projections go where the first was: see `fuse::linear::stack_group`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::ops::Op;
use crate::value::{DType, Value};

pub type Vid = usize;

/// Known dims (`None` where only run time knows).
pub type Dims = Option<Vec<Option<usize>>>;

#[derive(Clone, Debug, Default)]
pub struct Meta {
    pub name: String,
    pub dtype: Option<DType>,
    pub dims: Dims,
    pub konst: Option<Arc<Value>>,
}

#[derive(Clone, Debug)]
pub struct Node {
    pub name: String,
    /// `domain::op_type` as written in the model, for messages.
    pub origin: String,
    pub op: Op,
    pub inputs: Vec<Option<Vid>>,
    pub outputs: Vec<Vid>,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub values: Vec<Meta>,
    pub nodes: Vec<Option<Node>>,
    by_name: HashMap<String, Vid>,
}

impl Graph {
    /// The value called `name`, created on first use.
    pub fn value(&mut self, name: &str) -> Vid {
        if let Some(v) = self.by_name.get(name) {
            return *v;
        }
        let id = self.values.len();
        self.values.push(Meta { name: name.into(), ..Meta::default() });
        self.by_name.insert(name.into(), id);
        id
    }

    pub fn find(&self, name: &str) -> Option<Vid> {
        self.by_name.get(name).copied()
    }

    /// A fresh value for a pass to produce (named after `base`).
    pub fn fresh(&mut self, base: &str) -> Vid {
        let mut name = format!("{base}/fused");
        let mut i = 0;
        while self.by_name.contains_key(&name) {
            i += 1;
            name = format!("{base}/fused.{i}");
        }
        self.value(&name)
    }

    pub fn konst(&self, v: Vid) -> Option<&Value> {
        self.values[v].konst.as_deref()
    }

    pub fn live_nodes(&self) -> impl Iterator<Item = (usize, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
    }
}

/// Who produces and who consumes each value, as of when it was built.
pub struct Uses {
    pub producer: Vec<Option<usize>>,
    pub consumers: Vec<Vec<usize>>,
}

impl Uses {
    pub fn of(g: &Graph) -> Self {
        let mut producer = vec![None; g.values.len()];
        let mut consumers = vec![Vec::new(); g.values.len()];
        for (i, n) in g.live_nodes() {
            for o in &n.outputs {
                producer[*o] = Some(i);
            }
            for v in n.inputs.iter().flatten() {
                consumers[*v].push(i);
            }
        }
        Self { producer, consumers }
    }
}
