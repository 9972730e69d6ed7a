//! Pattern fusion. Each pass finds a subgraph by walking producers from a
//! root node, checks that no value inside it is read from outside, and
//! replaces it by one fused node at the root's position. A pattern that does
//! not match exactly is left to the generic kernels, which compute the same
//! result more slowly — except for KV-cache attention, which must fuse (the
//! compiler then refuses the graph, naming the node).

//!
//! One file per fusion family: `linear` (weight packing and what folds
//! into a projection), `norm`, `mlp` (gated MLP, GELU), `attention` (rotary,
//! KV-cache attention, head layout), `mask` (the causal-mask subgraph).

mod attention;
mod linear;

pub(crate) use linear::stack_siblings;
mod mask;
mod mlp;
mod norm;

use crate::compile::CompileStats;
use crate::error::CompileError;
use crate::graph::{Graph, Node, Uses, Vid};
use crate::kernels::elementwise::BinOp;
use crate::ops::Op;
use crate::value::Value;

type Pass = fn(&Graph, &Uses, usize) -> Result<Option<Rewrite>, CompileError>;

/// Replace `remove` (which includes the root) by `node` at the root, and
/// rewrite the nodes in `update` in place.
pub struct Rewrite {
    root: usize,
    remove: Vec<usize>,
    node: Node,
    update: Vec<(usize, Node)>,
}

impl Rewrite {
    pub(crate) fn new(root: usize, remove: Vec<usize>, node: Node) -> Self {
        Self { root, remove, node, update: Vec::new() }
    }
}

pub fn run(g: &mut Graph, stats: &mut CompileStats) -> Result<(), CompileError> {
    let passes: [(&str, Pass); 12] = [
        ("causal_mask", mask::causal_mask),
        ("linear", linear::pack_linear),
        ("matmul_nbits", linear::pack_nbits),
        ("q4_offsets", linear::q4_offsets),
        ("linear_bias", linear::linear_bias),
        // LayerNorm first: its centred core also looks like an RMSNorm.
        ("layer_norm", norm::layer_norm),
        ("rms_norm", norm::rms_norm),
        ("gated_mlp", mlp::gated_mlp),
        ("gelu_tanh", mlp::gelu_tanh),
        ("rotary", attention::rotary),
        ("attention", attention::attention),
        ("head_layout", attention::head_layout),
    ];
    for (name, pass) in passes {
        let mut count = 0;
        let mut i = 0;
        let mut uses = Uses::of(g);
        while i < g.nodes.len() {
            if g.nodes[i].is_some() {
                if let Some(rw) = pass(g, &uses, i)? {
                    for r in &rw.remove {
                        g.nodes[*r] = None;
                    }
                    for (at, node) in rw.update {
                        g.nodes[at] = Some(node);
                    }
                    g.nodes[rw.root] = Some(rw.node);
                    uses = Uses::of(g);
                    count += 1;
                }
            }
            i += 1;
        }
        if count > 0 {
            stats.fusions.push((name.to_string(), count));
        }
    }
    Ok(())
}

/// Read-only helpers over a graph and its use lists.
pub(crate) struct M<'a> {
    pub g: &'a Graph,
    pub u: &'a Uses,
}

impl<'a> M<'a> {
    pub(crate) fn producer(&self, v: Vid) -> Option<(usize, &'a Node)> {
        let i = self.u.producer[v]?;
        self.g.nodes[i].as_ref().map(|n| (i, n))
    }
    /// The producer of `v` if its op satisfies `pred`.
    pub(crate) fn from(&self, v: Vid, pred: impl Fn(&Op) -> bool) -> Option<(usize, &'a Node)> {
        self.producer(v).filter(|(_, n)| pred(&n.op))
    }
    pub(crate) fn input(n: &Node, i: usize) -> Option<Vid> {
        n.inputs.get(i).copied().flatten()
    }
    pub(crate) fn konst(&self, v: Vid) -> Option<&'a Value> {
        self.g.konst(v)
    }
    pub(crate) fn scalar(&self, v: Vid) -> Option<f32> {
        self.konst(v).and_then(Value::scalar_f32)
    }
    /// Whether every value `nodes` produce — except `exported` ones, which
    /// the fused node will produce itself — is read only inside `nodes`.
    pub(crate) fn private(&self, nodes: &[usize], exported: &[Vid]) -> bool {
        nodes
            .iter()
            .filter_map(|ni| self.g.nodes[*ni].as_ref())
            .flat_map(|n| n.outputs.iter())
            .all(|v| exported.contains(v) || self.read_only_by(*v, nodes))
    }

    /// Whether every reader of `v` is one of `nodes`.
    pub(crate) fn read_only_by(&self, v: Vid, nodes: &[usize]) -> bool {
        self.u.consumers[v].iter().all(|c| nodes.contains(c))
    }
    pub(crate) fn ints(&self, v: Option<Vid>) -> Option<&'a [i64]> {
        self.konst(v?).and_then(Value::ints)
    }
}

pub(crate) fn is_bin(op: &Op, b: BinOp) -> bool {
    matches!(op, Op::Binary(x) if *x == b)
}

pub(crate) fn fused(root: &Node, op: Op, inputs: Vec<Option<Vid>>, outputs: Vec<Vid>) -> Node {
    Node { name: root.name.clone(), origin: format!("fused {}", op.name()), op, inputs, outputs }
}
