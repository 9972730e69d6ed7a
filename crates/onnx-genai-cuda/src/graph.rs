//! A decode step captured as a CUDA graph. Stream capture drops the
//! programmatic-launch attribute of the launches it records (every edge of
//! a captured step came out a full dependency: 212 edges, 0 programmatic,
//! on an H200 with driver 580), so with overlap on, the edges between two
//! kernels are made programmatic before the graph is instantiated — each
//! kernel may then start, and load its weights, while the one before it
//! runs, as in an eager step — unless the step called a library (cuBLAS),
//! whose kernels do not wait for the kernel before them.

use cudarc::driver::{result, sys};

use crate::device::Device;
use crate::error::CudaError;

pub(crate) struct DeviceGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    stream: sys::CUstream,
}

impl Drop for DeviceGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were made by this graph and are destroyed
        // once (a null one was never made).
        unsafe {
            if !self.exec.is_null() {
                let _ = result::graph::exec_destroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

/// The edge data of a dependency a kernel may start across: the upstream
/// kernel's programmatic port (its blocks have all released dependents, or
/// exited), programmatic type (the downstream kernel waits at
/// `griddepcontrol.wait` for its completion).
fn programmatic_edge() -> sys::CUgraphEdgeData {
    // SAFETY: plain bytes; every field is set next.
    let mut e: sys::CUgraphEdgeData = unsafe { std::mem::zeroed() };
    e.from_port = sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8;
    e.type_ = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    e
}

impl DeviceGraph {
    /// Ends the capture on `dev`'s stream and instantiates what it
    /// recorded; `None` when nothing was. With `overlap` (which the caller
    /// gives only for a capture without library calls: every kernel in it
    /// is one of kernels/'s, which all wait for their dependency), every
    /// edge from a kernel to a kernel becomes programmatic.
    pub fn end_capture(dev: &Device, overlap: bool) -> Result<Option<Self>, CudaError> {
        let stream = dev.stream.cu_stream();
        // SAFETY: the stream is capturing (the caller began it).
        let graph = unsafe { result::stream::end_capture(stream) }?;
        if graph.is_null() {
            return Ok(None);
        }
        let mut this = Self { graph, exec: std::ptr::null_mut(), stream };
        if overlap {
            this.make_programmatic()?;
        }
        // SAFETY: `graph` is a complete graph this value owns.
        this.exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }?;
        Ok(Some(this))
    }

    pub fn launch(&self) -> Result<(), CudaError> {
        // SAFETY: the executable graph and the stream outlive the call.
        unsafe { result::graph::launch(self.exec, self.stream) }?;
        Ok(())
    }

    /// Every edge: from, to, data.
    fn edges(&self) -> Result<Vec<(sys::CUgraphNode, sys::CUgraphNode, sys::CUgraphEdgeData)>, CudaError> {
        let mut count = 0usize;
        let null = std::ptr::null_mut();
        // SAFETY: the first call only counts; the second fills buffers of
        // the counted length.
        unsafe {
            sys::cuGraphGetEdges_v2(self.graph, null, null, std::ptr::null_mut(), &mut count).result()?;
            let mut from: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
            let mut to: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
            let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); count];
            sys::cuGraphGetEdges_v2(self.graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut count)
                .result()?;
            Ok(from.into_iter().zip(to).zip(data).take(count).map(|((f, t), d)| (f, t, d)).collect())
        }
    }

    /// Whether `node` launches a kernel.
    fn is_kernel(node: sys::CUgraphNode) -> Result<bool, CudaError> {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to this graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut kind) }.result()?;
        Ok(kind == sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL)
    }

    fn make_programmatic(&mut self) -> Result<usize, CudaError> {
        let default = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_DEFAULT as u8;
        let wanted = programmatic_edge();
        let mut made = 0;
        for (from, to, data) in self.edges()? {
            if data.type_ != default || !Self::is_kernel(from)? || !Self::is_kernel(to)? {
                continue;
            }
            // SAFETY: the edge exists (just listed) between nodes of this
            // graph; it is replaced by one of the same ends.
            unsafe {
                sys::cuGraphRemoveDependencies_v2(self.graph, &from, &to, &data, 1).result()?;
                sys::cuGraphAddDependencies_v2(self.graph, &from, &to, &wanted, 1).result()?;
            }
            made += 1;
        }
        Ok(made)
    }

    /// Nodes, edges and programmatic edges.
    pub fn shape(&self) -> Result<(usize, usize, usize), CudaError> {
        let mut nodes = 0usize;
        // SAFETY: counts only.
        unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut nodes) }.result()?;
        let edges = self.edges()?;
        let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
        Ok((nodes, edges.len(), edges.iter().filter(|e| e.2.type_ == programmatic).count()))
    }
}

#[cfg(test)]
mod tests {
    use crate::device::{kernel_source, KERNELS};

    /// The body of the function whose definition starts at `at` (its
    /// outermost braces).
    fn body(src: &str, at: usize) -> &str {
        let open = at + src[at..].find('{').expect("a function body");
        let mut depth = 0;
        for (i, c) in src[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        return &src[open + 1..open + i];
                    }
                }
                _ => {}
            }
        }
        panic!("unbalanced braces after byte {at}");
    }

    /// What programmatic edges (and launches with programmatic stream
    /// serialization) rest on: every kernel in kernels/ reaches
    /// `GRID_DEPEND()` — the wait for the kernel before it — before any of
    /// its threads can return, and the template a kernel forwards to does
    /// too. A kernel without it would read its producer's output before
    /// that was written, or finish first and let the kernel after it
    /// overtake the one before.
    #[test]
    fn every_kernel_waits_for_the_kernel_before_it() {
        let src = kernel_source();
        let mut checked = Vec::new();
        for (at, _) in src.match_indices("extern \"C\" __global__") {
            let mut sig = &src[at..at + src[at..].find('{').expect("a body")];
            // `__launch_bounds__(...)` comes before the name.
            if let Some(lb) = sig.find("__launch_bounds__(") {
                let mut depth = 0;
                let close = sig[lb..]
                    .char_indices()
                    .find(|&(_, c)| {
                        depth += i32::from(c == '(') - i32::from(c == ')');
                        c == ')' && depth == 0
                    })
                    .expect("launch bounds close");
                sig = &sig[lb + close.0 + 1..];
            }
            let head = &sig[..sig.find('(').expect("a parameter list")];
            let name = head.rsplit(|c: char| c.is_whitespace()).next().expect("a kernel name").to_string();
            let mut code = body(src, at);
            // A kernel that forwards to a template: check the template.
            if let Some(call) = code.find("_body<") {
                let template = &code[..call].rsplit(|c: char| !c.is_alphanumeric() && c != '_').next().expect("a name");
                let def = src.find(&format!("void {template}_body(")).expect("the template's definition");
                code = body(src, def);
            }
            let wait = code.find("GRID_DEPEND();").unwrap_or_else(|| panic!("kernel `{name}` never waits"));
            assert!(!code[..wait].contains("return"), "kernel `{name}` may return before it waits");
            checked.push(name);
        }
        checked.sort();
        let mut listed: Vec<String> = KERNELS.iter().map(|k| k.to_string()).collect();
        listed.sort();
        assert_eq!(checked, listed, "every loaded kernel is checked");
    }
}
