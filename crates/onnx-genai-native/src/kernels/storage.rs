//! Where tiled weights live. A decode step streams every projection weight
//! once (about 100 MB a token on SmolLM2); on 4 KiB pages that is some
//! 25,000 pages a token, each a TLB miss and a page boundary the hardware
//! prefetcher stops at. The compiler therefore moves a plan's tiled
//! weights into one arena aligned to a 2 MiB huge page and marked for
//! transparent huge pages (`madvise(MADV_HUGEPAGE)`, honoured unless the
//! system's THP mode is `never`) before anything is written to it, so its
//! pages fault in huge as the weights are copied. Where the hint is
//! refused the arena is ordinary memory and nothing else changes; the
//! bytes, and so every result, are the same wherever they live.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;

use super::weights::{Line, Tiled};

/// The huge page size the arena is aligned to (x86-64's 2 MiB).
pub const HUGE_PAGE: usize = 2 << 20;

/// A tiled weight's lines: its own vector (as repacked), or a run of a
/// shared [`Arena`].
#[derive(Clone, Debug)]
pub struct Lines(Place);

#[derive(Clone, Debug)]
enum Place {
    Own(Vec<Line>),
    Arena { arena: Arc<Arena>, start: usize, len: usize },
}

impl From<Vec<Line>> for Lines {
    fn from(lines: Vec<Line>) -> Self {
        Self(Place::Own(lines))
    }
}

impl Lines {
    pub fn as_slice(&self) -> &[Line] {
        match &self.0 {
            Place::Own(lines) => lines,
            Place::Arena { arena, start, len } => &arena.as_slice()[*start..*start + *len],
        }
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The arena these lines live in, if they were gathered into one.
    pub fn arena(&self) -> Option<&Arena> {
        match &self.0 {
            Place::Own(_) => None,
            Place::Arena { arena, .. } => Some(arena),
        }
    }
}

/// Values whose all-zero bytes are a valid value, so a [`HugeBuf`] of
/// them may start zeroed.
pub trait ZeroValid: Copy {}
impl ZeroValid for f32 {}
impl ZeroValid for half::f16 {}
impl ZeroValid for Line {}

/// `len` values in one allocation aligned to [`HUGE_PAGE`], its whole huge
/// pages advised for transparent huge pages before anything touched them
/// (so they fault in huge). Only whole huge pages are advised: a partial
/// one at the end would fault in 2 MiB for the rest of a page the buffer
/// does not use. The KV cache's blocks and the weight arena live in these.
pub struct HugeBuf<T: ZeroValid> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
    huge: bool,
    /// Mapped fresh from the kernel ([`fresh_pages`]), given back with
    /// `munmap`; otherwise from the global allocator.
    mapped: bool,
}

// SAFETY: a `HugeBuf` owns its values like a `Box<[T]>` does; through
// its safe methods shared references only read them and writes need
// `&mut`. The one other way in, `base`'s raw pointer, is used by the KV
// cache's chunks, which hand each part to one holder only (`kv::Region`).
unsafe impl<T: ZeroValid + Send> Send for HugeBuf<T> {}
// SAFETY: as above.
unsafe impl<T: ZeroValid + Sync> Sync for HugeBuf<T> {}

impl<T: ZeroValid> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HugeBuf({} values, huge pages asked: {})", self.len, self.huge)
    }
}

impl<T: ZeroValid> HugeBuf<T> {
    /// `len` zeroed values (aborts on allocation failure, as `vec!` does).
    pub fn zeroed(len: usize) -> Self {
        Self::zeroed_in(len, false)
    }

    /// [`zeroed`](Self::zeroed), its size rounded up to whole huge pages,
    /// all of them advised: for a buffer whose last partial huge page is
    /// worth its unused rest (the KV cache's chunks waste at most 1/64).
    pub fn zeroed_whole_pages(len: usize) -> Self {
        Self::zeroed_in(len, true)
    }

    fn zeroed_in(len: usize, whole_pages: bool) -> Self {
        let buf = Self::uninit_in(len, whole_pages);
        if !buf.mapped {
            // SAFETY: the allocation holds `len` values of `T`; all-zero
            // bytes are a valid `T` (`ZeroValid`). (Fresh pages are zero
            // already, and writing them would fault every one in now.)
            unsafe { std::ptr::write_bytes(buf.ptr.as_ptr(), 0, len) };
        }
        buf
    }

    /// `len` values, not yet written (fresh pages read as zero): every one
    /// must be written before the buffer is read (`gather` does; `zeroed`
    /// does).
    ///
    /// The memory comes straight from the kernel where it can: an
    /// allocator hands out memory it got back from earlier frees — a model
    /// compile frees hundreds of MB just before its arena is made — whose
    /// pages were faulted in small, and advising those pages changes
    /// nothing (in one `cargo xtask bench --scaling` process, three
    /// SmolLM2 models' arenas held 36 MB of huge pages between them).
    fn uninit(len: usize) -> Self {
        Self::uninit_in(len, false)
    }

    fn uninit_in(len: usize, whole_pages: bool) -> Self {
        let values = len.checked_mul(std::mem::size_of::<T>()).expect("buffer size overflows");
        let bytes = if whole_pages {
            values.checked_next_multiple_of(HUGE_PAGE).expect("buffer size overflows")
        } else {
            values
        };
        let layout = Layout::from_size_align(bytes, HUGE_PAGE).expect("buffer layout");
        if bytes == 0 {
            return Self { ptr: NonNull::dangling(), len: 0, layout, huge: false, mapped: false };
        }
        // (A buffer of less than a huge page gets none: the allocator's
        // memory serves it as well, without a mapping of its own.)
        let whole = bytes / HUGE_PAGE * HUGE_PAGE;
        let (raw, mapped) = match (whole > 0).then(|| fresh_pages(bytes)).flatten() {
            Some(p) => (p, true),
            // SAFETY: the layout's size is non-zero.
            None => (unsafe { std::alloc::alloc(layout) }, false),
        };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { std::alloc::handle_alloc_error(layout) };
        let huge = whole > 0 && advise_huge_pages(raw, whole);
        Self { ptr, len, layout, huge, mapped }
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialized values (see `uninit`) and
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only
        // reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Whether the OS accepted the huge-page hint (false for buffers
    /// smaller than one huge page).
    pub fn huge_pages_asked(&self) -> bool {
        self.huge
    }

    /// The first byte (its alignment is observable in tests).
    pub fn start(&self) -> *const u8 {
        self.ptr.as_ptr().cast()
    }

    /// The first value, for owners that hand out disjoint parts of the
    /// buffer to different holders (the KV cache's chunks): such an owner
    /// must not call [`as_slice`](Self::as_slice) or `as_mut_slice` (or
    /// clone the buffer) while any part is in use, and no two holders may
    /// reach the same part.
    pub(crate) fn base(&self) -> *mut T {
        self.ptr.as_ptr()
    }
}

/// Gives the memory of the whole pages inside `bytes` bytes at `start`
/// back to the OS: they read as zero afterwards (a page the range shares
/// with a neighbour is kept, so no byte outside the range changes).
///
/// # Safety
/// The range must lie in one live allocation of this process, and no one
/// may rely on what it holds (its values become zero).
pub(crate) unsafe fn release_pages(start: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        let page = page_size();
        let first = (start as usize).next_multiple_of(page);
        let end = (start as usize + bytes) / page * page;
        if end > first {
            // SAFETY: the caller's contract; the pages lie wholly inside
            // the range, and MADV_DONTNEED on private anonymous memory
            // only makes them read as zero.
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

impl<T: ZeroValid> Clone for HugeBuf<T> {
    fn clone(&self) -> Self {
        let copy = Self::uninit(self.len);
        // SAFETY: both hold `len` values; `copy` is a fresh allocation, so
        // they do not overlap; this writes every value of `copy`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), copy.ptr.as_ptr(), self.len) };
        copy
    }
}

impl<T: ZeroValid> Drop for HugeBuf<T> {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: mapped by `fresh_pages` for exactly this many bytes,
            // and not used after this.
            unsafe { unmap_pages(self.ptr.as_ptr().cast(), self.layout.size()) }
        } else if self.layout.size() > 0 {
            // SAFETY: allocated in `uninit` with exactly this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), self.layout) }
        }
    }
}

/// The lines every gathered weight of a plan shares.
pub type Arena = HugeBuf<Line>;

/// Moves the lines of every weight in `tiles` into one new arena, in order,
/// freeing each weight's own vector as soon as it is copied (so the peak is
/// the weights plus one of them, not twice the weights). Returns the arena,
/// or `None` (every weight left as it was) when there is nothing to gather.
pub fn gather(tiles: &mut [&mut Tiled]) -> Option<Arc<Arena>> {
    let total: usize = tiles.iter().map(|t| t.lines.len()).sum();
    if total == 0 {
        return None;
    }
    let arena = Arena::uninit(total);
    let base = arena.ptr.as_ptr();
    let mut starts = Vec::with_capacity(tiles.len());
    let mut at = 0;
    for t in tiles.iter_mut() {
        let own = std::mem::replace(&mut t.lines, Lines::from(Vec::new()));
        let src = own.as_slice();
        // SAFETY: lines `at..at + src.len()` lie inside the `total` lines
        // allocated (the lengths sum to `total`, so together the copies
        // write every line before the arena is read), and a fresh
        // allocation cannot overlap `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), base.add(at), src.len()) };
        starts.push((at, src.len()));
        at += src.len();
    }
    let arena = Arc::new(arena);
    for (t, (start, len)) in tiles.iter_mut().zip(starts) {
        t.lines = Lines(Place::Arena { arena: arena.clone(), start, len });
    }
    Some(arena)
}

/// `bytes` (> 0) of fresh, zero, never touched memory starting on a
/// [`HUGE_PAGE`] boundary, mapped from the kernel (`None` where that
/// fails, or off Linux: the caller uses the allocator instead). A mapping
/// of a huge page more is trimmed to the aligned run.
#[cfg(target_os = "linux")]
fn fresh_pages(bytes: usize) -> Option<*mut u8> {
    let len = bytes.checked_next_multiple_of(page_size())?;
    let span = len.checked_add(HUGE_PAGE)?;
    // SAFETY: an anonymous private mapping at an address the kernel picks
    // touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let raw = raw.cast::<u8>();
    let head = (raw as usize).next_multiple_of(HUGE_PAGE) - raw as usize;
    let tail = span - head - len;
    // SAFETY: `head` and `tail` (multiples of the page size: the mapping
    // and `HUGE_PAGE` are page-aligned, `len` is rounded up) cut the span
    // into three page-aligned runs of our own fresh mapping; the ends are
    // given back, the middle `len` bytes stay mapped. (Should a trim fail,
    // at the process's limit of mappings, its untouched end stays mapped
    // and unused: address space, no memory.)
    unsafe {
        let start = raw.add(head);
        if head > 0 {
            libc::munmap(raw.cast(), head);
        }
        if tail > 0 {
            libc::munmap(start.add(len).cast(), tail);
        }
        Some(start)
    }
}

#[cfg(not(target_os = "linux"))]
fn fresh_pages(_bytes: usize) -> Option<*mut u8> {
    None
}

/// Gives back what [`fresh_pages`] mapped for `bytes`.
///
/// # Safety
/// `start` and `bytes` must be a mapping `fresh_pages` returned, not used
/// after this.
#[cfg(target_os = "linux")]
unsafe fn unmap_pages(start: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract; `munmap` rounds `bytes` up to whole
    // pages, as `fresh_pages` mapped them.
    unsafe { libc::munmap(start.cast(), bytes) };
}

#[cfg(not(target_os = "linux"))]
unsafe fn unmap_pages(_start: *mut u8, _bytes: usize) {}

#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: `sysconf` reads a configuration value.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: *mut u8, bytes: usize) -> bool {
    // SAFETY: `madvise` only changes how the kernel backs the pages of this
    // range, which lies in our own allocation and starts on a page
    // boundary (it is aligned to a huge page); it reads and writes no
    // memory.
    unsafe { libc::madvise(start.cast(), bytes, libc::MADV_HUGEPAGE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_start: *mut u8, _bytes: usize) -> bool {
    false
}

/// Whether the mapping holding `at` may get transparent huge pages,
/// where that says whether it was advised: Linux with THP on `madvise`
/// (`None` elsewhere: nothing to observe). A probe for the tests of this
/// module and of `kv`, which read `/proc/self/smaps`.
#[cfg(test)]
pub(crate) fn thp_eligible(at: *const u8) -> Option<bool> {
    thp_on_madvise()?;
    Some(smaps_field(at, "THPeligible:").trim() == "1")
}

/// The system's THP mode is `madvise` (`None`, said on stderr, otherwise).
#[cfg(test)]
fn thp_on_madvise() -> Option<()> {
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    if !mode.contains("[madvise]") {
        eprintln!("THP mode is not madvise ({}); nothing to observe", mode.trim());
        return None;
    }
    Some(())
}

/// How often the kernel has fallen back to small pages where a fault could
/// have taken a huge one (`/proc/vmstat`; 0 where unreadable).
#[cfg(test)]
fn thp_fault_fallbacks() -> u64 {
    let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
    vmstat.lines().find_map(|l| l.strip_prefix("thp_fault_fallback ")?.trim().parse().ok()).unwrap_or(0)
}

/// Of the whole pages inside `bytes` bytes at `start`, how many are
/// resident, and how many there are (`mincore`: exact for the range, not
/// the mapping around it; `None` off Linux or where the call fails).
#[cfg(test)]
pub(crate) fn resident_pages(start: *const u8, bytes: usize) -> Option<(usize, usize)> {
    #[cfg(target_os = "linux")]
    {
        let page = page_size();
        let first = (start as usize).next_multiple_of(page);
        let end = (start as usize + bytes) / page * page;
        let pages = end.saturating_sub(first) / page;
        let mut flags = vec![0u8; pages];
        // SAFETY: `mincore` writes one byte per page of the range into
        // `flags`, which holds that many; the range is page-aligned.
        let rc = unsafe { libc::mincore(first as *mut libc::c_void, end - first, flags.as_mut_ptr()) };
        (rc == 0).then(|| (flags.iter().filter(|f| *f & 1 == 1).count(), pages))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (start, bytes);
        None
    }
}

/// The value of `field` for the mapping holding `at`, in
/// `/proc/self/smaps`.
#[cfg(test)]
fn smaps_field(at: *const u8, field: &str) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut inside = false;
    for line in smaps.lines() {
        let range = line.split_once(' ').and_then(|(r, _)| r.split_once('-'));
        if let Some((lo, hi)) = range {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                inside = (lo..hi).contains(&(at as usize));
                continue;
            }
        }
        if let (true, Some(v)) = (inside, line.strip_prefix(field)) {
            return v.to_string();
        }
    }
    panic!("no mapping in /proc/self/smaps holds {at:?} with {field}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::weights::{Packed, Weight};

    fn tiled(n: usize, k: usize, seed: usize) -> Tiled {
        let values = (0..n * k).map(|i| ((i * 7 + seed * 13) % 23) as f32 - 11.0).collect();
        Tiled::from_rows(&Weight { n, k, packed: Packed::F32(values) }).unwrap()
    }

    /// Gathering moves bytes, never changes them: every weight reads the
    /// same rows from the arena as from its own vector, the arena starts
    /// on a huge page, and it is one allocation holding all of them back
    /// to back.
    #[test]
    fn gathered_weights_read_the_same_rows_from_one_aligned_arena() {
        let mut weights = [tiled(40, 24, 1), tiled(16, 64, 2), tiled(53, 8, 3)];
        let before: Vec<Vec<u8>> = weights.iter().map(|t| t.as_bytes().to_vec()).collect();
        let rows = |t: &Tiled| -> Vec<Vec<f32>> {
            (0..t.n)
                .map(|r| {
                    let mut out = vec![0.0; t.k];
                    t.row(r, &mut out);
                    out
                })
                .collect()
        };
        let rows_before: Vec<_> = weights.iter().map(rows).collect();
        let mut refs: Vec<&mut Tiled> = weights.iter_mut().collect();
        let arena = gather(&mut refs).expect("an arena");
        assert_eq!(arena.start() as usize % HUGE_PAGE, 0, "the arena starts on a huge page");
        assert_eq!(arena.as_slice().len(), before.iter().map(|b| b.len() / 64).sum::<usize>());
        let mut next = arena.start();
        for (i, t) in weights.iter().enumerate() {
            assert_eq!(t.as_bytes(), &before[i][..], "weight {i}'s bytes");
            assert_eq!(rows(t), rows_before[i], "weight {i}'s rows");
            assert_eq!(t.as_bytes().as_ptr(), next, "weight {i} follows the one before it");
            assert!(t.lines.arena().is_some());
            next = next.wrapping_add(t.bytes());
        }
        assert!(gather(&mut []).is_none(), "nothing to gather allocates nothing");
    }

    /// Where the system's transparent huge pages are on `madvise` (as on
    /// the CI machines), only an advised mapping is eligible: the arena's
    /// mapping must say `THPeligible: 1` in `/proc/self/smaps`.
    #[test]
    fn the_arena_is_advised_for_huge_pages() {
        let mut weights = [tiled(16 * 512, 64, 4)];
        let mut refs: Vec<&mut Tiled> = weights.iter_mut().collect();
        let arena = gather(&mut refs).expect("an arena");
        if let Some(eligible) = thp_eligible(arena.start()) {
            assert!(arena.huge_pages_asked(), "madvise refused");
            assert!(eligible, "the arena's mapping is not eligible for huge pages");
        }
    }

    /// Advising memory the allocator had handed out and taken back before
    /// changes nothing: its pages were faulted in small. A buffer made
    /// right after such a free (as a compile frees hundreds of MB just
    /// before gathering its arena) still comes in huge pages, where THP is
    /// on `madvise`: its memory is mapped fresh. (Taken from the allocator,
    /// it was the freed run, handed straight back: no huge page.)
    #[test]
    fn a_buffer_made_after_a_free_still_comes_in_huge_pages() {
        let bytes = 16 << 20;
        // Blocks the allocator keeps in its own heap (below its threshold
        // for mapping a block apart), touched, then freed together under a
        // fence it cannot trim past: one free run of 24 MiB of small pages.
        let chunks: Vec<Vec<u8>> = (0..384).map(|_| vec![1u8; 64 << 10]).collect();
        let fence = vec![1u8; 64 << 10];
        drop(chunks);
        let fallbacks = thp_fault_fallbacks();
        let mut buf = HugeBuf::<f32>::zeroed(bytes / 4);
        buf.as_mut_slice().iter_mut().step_by(1024).for_each(|v| *v = 1.0);
        if thp_on_madvise().is_none() {
            return;
        }
        if thp_fault_fallbacks() != fallbacks {
            // The kernel found no free 2 MiB run for some fault (here or in
            // another test's thread): small pages then say nothing.
            eprintln!("the kernel fell back to small pages during the test; nothing to observe");
            return;
        }
        let kb: usize =
            smaps_field(buf.start(), "AnonHugePages:").trim().trim_end_matches("kB").trim().parse().expect("kB");
        assert!(kb >= bytes / 1024, "the buffer's mapping holds {kb} kB of huge pages, {} expected", bytes / 1024);
        drop(fence);
    }
}
