//! Anonymous page mappings a load reads into, returned to the OS piece by piece
//! ([`SharedPages`], [`PageSpan`]), and prefaulting a destination ahead of its reads
//! ([`populate_write`]).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::DIRECT_ALIGN_BYTES;
use crate::round_up;

/// Faults in (allocates and zeroes) the pages under `[addr, addr + len_bytes)` that are not
/// present yet, without changing any byte: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+).
/// Returns false where the kernel refuses (older kernels, file-backed or locked memory); the
/// pages are then faulted in by whoever touches them first, as usual.
///
/// A read job calls this from a second thread ahead of its reads, so that the kernel's page
/// faults on a fresh destination (about 1 us per 4 KiB page here, a third of a fast drive's
/// time) do not serialise with the submissions.
///
/// It takes an address rather than a slice because the bytes are borrowed mutably elsewhere
/// meanwhile (by the reads); it never reads or writes them.
pub fn populate_write(addr: usize, len_bytes: usize) -> bool {
    if len_bytes == 0 {
        return true;
    }
    let page = DIRECT_ALIGN_BYTES;
    let start = addr & !(page - 1);
    let end = round_up(addr + len_bytes, page);
    // SAFETY: madvise acts only on the page tables of [start, end); an address range this
    // process has not mapped writable makes it fail (ENOMEM/EFAULT), not touch memory. With
    // MADV_POPULATE_WRITE it allocates missing pages and never changes the value of a byte, so
    // it is sound even while other threads, or the kernel's own reads, write to that memory.
    let rc = unsafe {
        libc::madvise(
            start as *mut libc::c_void,
            end - start,
            libc::MADV_POPULATE_WRITE,
        )
    };
    rc == 0
}

/// The size (and alignment) of a transparent huge page on x86_64 and of the PMD-level pages
/// of other 4 KiB-page architectures.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A shared read-write mapping of the first `len_bytes` (more than 0) of `file`, not inherited
/// by a forked child (a DataLoader worker would keep the file's memory after this process let it
/// go; best effort: a failed advice changes nothing else). The caller unmaps it with `munmap`.
pub(crate) fn map_shared(file: &std::fs::File, len_bytes: usize) -> std::io::Result<NonNull<u8>> {
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh mapping chosen by the kernel (no address hint) of a file the caller holds
    // open; it touches no existing memory, and the result is checked before use.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: advice on the live mapping just made; it reads or writes no memory.
    unsafe { libc::madvise(raw, len_bytes, libc::MADV_DONTFORK) };
    Ok(NonNull::new(raw.cast::<u8>()).expect("mmap returned a null mapping"))
}

/// A private anonymous read-write mapping of `len_bytes` (a multiple of the page size).
fn map_anonymous(len_bytes: usize) -> std::io::Result<NonNull<u8>> {
    // SAFETY: an anonymous private mapping with no address hint touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(NonNull::new(raw.cast::<u8>()).expect("mmap returned a null mapping"))
}

/// `map_anonymous(len_bytes)` starting on a [`HUGE_PAGE_BYTES`] boundary and advised for
/// transparent huge pages. The kernel only backs 2 MiB-aligned ranges with huge pages, and
/// does not align every large mapping itself, so this maps one huge page more and unmaps the
/// slack before and after the aligned range. Returned to the OS with [`unmap_anonymous`].
pub(crate) fn map_huge_aligned(len_bytes: usize) -> std::io::Result<NonNull<u8>> {
    let padded = len_bytes + HUGE_PAGE_BYTES;
    let raw = map_anonymous(padded)?.as_ptr() as usize;
    let start = round_up(raw, HUGE_PAGE_BYTES);
    let head = start - raw;
    let tail = padded - head - len_bytes;
    // SAFETY: [raw, start) and [start + len_bytes, raw + padded) lie inside the mapping just
    // made, which nothing else knows of; both are page-aligned (raw, start and len_bytes are).
    // A failed munmap only leaves that slack mapped.
    unsafe {
        if head > 0 {
            libc::munmap(raw as *mut libc::c_void, head);
        }
        if tail > 0 {
            libc::munmap((start + len_bytes) as *mut libc::c_void, tail);
        }
    }
    // SAFETY: madvise(MADV_HUGEPAGE) changes only how the kernel backs our own fresh mapping,
    // never a byte of it; an error (THP compiled out) leaves ordinary pages.
    unsafe { libc::madvise(start as *mut libc::c_void, len_bytes, libc::MADV_HUGEPAGE) };
    Ok(NonNull::new(start as *mut u8).expect("an aligned address inside a mapping is not null"))
}

/// Unmaps `[ptr, ptr + len_bytes)`.
///
/// # Safety
/// The range must be a mapping made by [`map_anonymous`] or [`map_huge_aligned`], or a
/// page-aligned part of one, and no reference into it may be used afterwards.
pub(crate) unsafe fn unmap_anonymous(ptr: NonNull<u8>, len_bytes: usize) {
    // SAFETY: the caller owns the range and gives it up; a failed munmap only leaks it.
    unsafe { libc::munmap(ptr.as_ptr().cast(), len_bytes) };
}

/// Anonymous page-aligned memory whose pages are returned to the OS piece by piece: each
/// [`PageSpan`] holds the pages under its byte range, and a page is unmapped once no span
/// holds it. A loaded checkpoint is read into one such mapping (one O_DIRECT pass), then cut
/// into a span per large tensor, so that dropping some tensors frees their memory even while
/// others are kept.
pub struct SharedPages {
    base: NonNull<u8>,
    len_bytes: usize,
    /// Spans holding each page; a page whose count drops to zero is unmapped.
    holders: std::sync::Mutex<Vec<u32>>,
}

// SAFETY: the mapping is owned by this struct alone; the memory is only reached through
// PageSpans, whose users coordinate access like users of any shared buffer, and the holder
// counts are behind a Mutex.
unsafe impl Send for SharedPages {}
// SAFETY: see above.
unsafe impl Sync for SharedPages {}

impl fmt::Debug for SharedPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedPages")
            .field("len_bytes", &self.len_bytes)
            .finish_non_exhaustive()
    }
}

impl SharedPages {
    /// Maps `len_bytes` (rounded up to whole pages, at least one) of zeroed memory, and returns
    /// one span over all of it.
    ///
    /// A mapping of at least [`HUGE_PAGE_BYTES`] starts on a huge-page boundary and is advised
    /// for transparent huge pages (`MADV_HUGEPAGE`; where THP is "never" or unsupported the
    /// advice is ignored): the first touch of a fresh 1 GiB load destination then takes 512
    /// faults instead of 262,144 (0.17-0.26 s instead of 0.54-0.69 s here, most of it zeroing),
    /// and that first touch is part of every cold load. Spans still return their pages as
    /// before; unmapping part of a huge page splits it.
    pub fn map(len_bytes: usize) -> std::io::Result<PageSpan> {
        let mapped = round_up(len_bytes.max(1), DIRECT_ALIGN_BYTES);
        let base = if mapped >= HUGE_PAGE_BYTES {
            map_huge_aligned(mapped)?
        } else {
            map_anonymous(mapped)?
        };
        let pages = Arc::new(SharedPages {
            base,
            len_bytes: mapped,
            holders: std::sync::Mutex::new(vec![0; mapped / DIRECT_ALIGN_BYTES]),
        });
        Ok(PageSpan::hold(pages, 0, len_bytes))
    }

    fn page_range(offset_bytes: usize, len_bytes: usize) -> std::ops::Range<usize> {
        let first = offset_bytes / DIRECT_ALIGN_BYTES;
        let end = (offset_bytes + len_bytes.max(1)).div_ceil(DIRECT_ALIGN_BYTES);
        first..end
    }

    fn hold(&self, pages: std::ops::Range<usize>) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        for count in &mut holders[pages] {
            *count += 1;
        }
    }

    fn release(&self, pages: std::ops::Range<usize>) {
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let mut run_start = None;
        for page in pages.clone() {
            holders[page] -= 1;
            let free = holders[page] == 0;
            match (free, run_start) {
                (true, None) => run_start = Some(page),
                (false, Some(start)) => {
                    self.unmap(start..page);
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(start) = run_start {
            self.unmap(start..pages.end);
        }
    }

    fn unmap(&self, pages: std::ops::Range<usize>) {
        // SAFETY: these pages lie inside our mapping (so `add` stays in bounds), are
        // page-aligned, and no span holds them any more, so no reference into them can be used
        // again. A failure (ENOMEM splitting the mapping) only leaks the pages.
        unsafe {
            let start = self.base.add(pages.start * DIRECT_ALIGN_BYTES);
            unmap_anonymous(start, pages.len() * DIRECT_ALIGN_BYTES);
        }
    }
}

/// A byte range of [`SharedPages`] that keeps the pages under it mapped while it lives.
#[derive(Debug)]
pub struct PageSpan {
    pages: Arc<SharedPages>,
    offset_bytes: usize,
    len_bytes: usize,
}

impl PageSpan {
    fn hold(pages: Arc<SharedPages>, offset_bytes: usize, len_bytes: usize) -> Self {
        pages.hold(SharedPages::page_range(offset_bytes, len_bytes));
        PageSpan {
            pages,
            offset_bytes,
            len_bytes,
        }
    }

    /// A span over `len_bytes` at `offset_bytes` of this span (None if it does not fit).
    pub fn sub(&self, offset_bytes: usize, len_bytes: usize) -> Option<PageSpan> {
        let end = offset_bytes.checked_add(len_bytes)?;
        (end <= self.len_bytes).then(|| {
            PageSpan::hold(
                Arc::clone(&self.pages),
                self.offset_bytes + offset_bytes,
                len_bytes,
            )
        })
    }

    /// The first byte (page-aligned when the span starts at offset 0 of its mapping).
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset_bytes <= the mapping's length (checked when the span was made).
        unsafe { self.pages.base.as_ptr().add(self.offset_bytes) }
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Drop for PageSpan {
    fn drop(&mut self) {
        self.pages
            .release(SharedPages::page_range(self.offset_bytes, self.len_bytes));
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn resident(span: &PageSpan) -> bool {
        let mut vec = [0u8; 1];
        let page = (span.as_ptr() as usize) & !(DIRECT_ALIGN_BYTES - 1);
        // SAFETY: mincore only inspects the mapping; ENOMEM means the page is unmapped.
        unsafe {
            libc::mincore(
                page as *mut libc::c_void,
                DIRECT_ALIGN_BYTES,
                vec.as_mut_ptr(),
            ) == 0
        }
    }

    #[test]
    fn pages_are_unmapped_when_their_last_span_goes() {
        let whole = SharedPages::map(8 * DIRECT_ALIGN_BYTES).unwrap();
        // SAFETY: the span covers 8 pages of our own mapping.
        unsafe { whole.as_ptr().write_bytes(7, 8 * DIRECT_ALIGN_BYTES) };
        let a = whole.sub(100, 2 * DIRECT_ALIGN_BYTES).unwrap(); // pages 0..3
        let b = whole.sub(5 * DIRECT_ALIGN_BYTES, 100).unwrap(); // page 5
        assert!(whole.sub(8 * DIRECT_ALIGN_BYTES, 1).is_none());
        drop(whole);
        assert!(resident(&a) && resident(&b));
        // SAFETY: `a` holds its pages.
        assert_eq!(unsafe { *a.as_ptr() }, 7);
        let b_ptr = b.as_ptr() as usize;
        drop(b);
        let mut vec = [0u8; 1];
        // SAFETY: mincore on an unmapped page fails with ENOMEM and touches nothing.
        let rc =
            unsafe { libc::mincore((b_ptr & !4095) as *mut libc::c_void, 4096, vec.as_mut_ptr()) };
        assert_eq!(
            rc, -1,
            "page 5 should be unmapped once its only span is dropped"
        );
        assert!(resident(&a));
    }

    #[test]
    fn populate_write_faults_pages_in_and_changes_no_byte() {
        let pages = 16;
        let span = SharedPages::map(pages * DIRECT_ALIGN_BYTES).unwrap();
        let base = span.as_ptr();
        // SAFETY: page 3 lies inside our own 16-page mapping.
        unsafe { base.add(3 * DIRECT_ALIGN_BYTES + 5).write(42) };
        let mut vec = vec![0u8; pages];
        let residency = |vec: &mut Vec<u8>| {
            // SAFETY: mincore only inspects our own mapping and fills one byte per page.
            let rc =
                unsafe { libc::mincore(base.cast(), pages * DIRECT_ALIGN_BYTES, vec.as_mut_ptr()) };
            assert_eq!(rc, 0);
            vec.iter().filter(|&&v| v & 1 == 1).count()
        };
        assert_eq!(residency(&mut vec), 1, "only the written page is resident");
        // An unaligned range rounds out to the pages under it: 2..=9 here.
        if !populate_write(
            base as usize + 2 * DIRECT_ALIGN_BYTES + 100,
            7 * DIRECT_ALIGN_BYTES,
        ) {
            eprintln!("skipping: this kernel refuses MADV_POPULATE_WRITE");
            return;
        }
        assert_eq!(residency(&mut vec), 8);
        assert!(vec[2..10].iter().all(|&v| v & 1 == 1));
        assert!(
            populate_write(base as usize, 0),
            "an empty range is a no-op"
        );
        // SAFETY: the whole mapping is ours; nothing writes to it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(base, pages * DIRECT_ALIGN_BYTES) };
        let nonzero: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] != 0).collect();
        assert_eq!(nonzero, vec![3 * DIRECT_ALIGN_BYTES + 5]);
        assert_eq!(bytes[3 * DIRECT_ALIGN_BYTES + 5], 42);
    }

    /// The smaps block of the mapping that contains `addr`, if any.
    pub(crate) fn smaps_block(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut block: Option<String> = None;
        for line in smaps.lines() {
            let header = line
                .split_once(' ')
                .and_then(|(range, _)| range.split_once('-'))
                .and_then(|(lo, hi)| {
                    Some((
                        usize::from_str_radix(lo, 16).ok()?,
                        usize::from_str_radix(hi, 16).ok()?,
                    ))
                });
            if let Some((lo, hi)) = header {
                if block.is_some() {
                    break;
                }
                if (lo..hi).contains(&addr) {
                    block = Some(String::new());
                }
            } else if let Some(text) = block.as_mut() {
                text.push_str(line);
                text.push('\n');
            }
        }
        block
    }

    #[test]
    fn a_large_mapping_starts_on_a_huge_page_and_is_advised_for_them() {
        let len = 2 * HUGE_PAGE_BYTES + 5;
        let whole = SharedPages::map(len).unwrap();
        let base = whole.as_ptr() as usize;
        assert_eq!(
            base % HUGE_PAGE_BYTES,
            0,
            "not huge-page aligned: {base:#x}"
        );
        // SAFETY: the span covers `len` bytes of our own mapping.
        unsafe { whole.as_ptr().write_bytes(9, len) };
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        match (thp, smaps_block(base)) {
            (Ok(mode), Some(block)) if !mode.contains("[never]") => assert!(
                advised_huge(&block),
                "THP is {mode:?} but the mapping is not eligible:\n{block}"
            ),
            _ => eprintln!("skipping the THP check: THP is off or smaps is unreadable"),
        }
        // Spans still hold and free their own pages inside huge pages.
        let tail = whole.sub(HUGE_PAGE_BYTES + 4096, 10).unwrap();
        drop(whole);
        // SAFETY: `tail` holds its page.
        assert_eq!(unsafe { *tail.as_ptr() }, 9);
        assert!(resident(&tail));
        let tail_ptr = tail.as_ptr() as usize;
        drop(tail);
        let mut vec = [0u8; 1];
        // SAFETY: mincore on an unmapped page fails with ENOMEM and touches nothing.
        let rc = unsafe { libc::mincore(tail_ptr as *mut libc::c_void, 4096, vec.as_mut_ptr()) };
        assert_eq!(rc, -1, "the last span's page should be unmapped");
    }

    #[test]
    fn a_small_mapping_is_left_to_ordinary_pages() {
        let span = SharedPages::map(HUGE_PAGE_BYTES - DIRECT_ALIGN_BYTES).unwrap();
        if let Some(block) = smaps_block(span.as_ptr() as usize) {
            assert!(!advised_huge(&block), "{block}");
        }
    }

    /// Whether an smaps block's VmFlags carry "hg" (advised MADV_HUGEPAGE).
    pub(crate) fn advised_huge(block: &str) -> bool {
        block
            .lines()
            .filter_map(|l| l.strip_prefix("VmFlags:"))
            .any(|flags| flags.split_whitespace().any(|f| f == "hg"))
    }
}
