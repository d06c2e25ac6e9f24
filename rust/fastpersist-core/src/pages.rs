//! Anonymous page mappings a load reads into, returned to the OS piece by piece
//! ([`SharedPages`], [`PageSpan`]), and prefaulting a destination ahead of its reads
//! ([`populate_write`]).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::DIRECT_ALIGN_BYTES;
use crate::align::round_up;

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
    pub fn map(len_bytes: usize) -> std::io::Result<PageSpan> {
        let mapped = round_up(len_bytes.max(1), DIRECT_ALIGN_BYTES);
        // SAFETY: an anonymous private mapping with no address hint touches no existing memory.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(raw.cast::<u8>()).expect("mmap returned a null mapping");
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
        // SAFETY: these pages lie inside our mapping and no span holds them any more, so no
        // reference into them can be used again; munmap of a sub-range of an anonymous
        // mapping is allowed. A failure (ENOMEM splitting the mapping) only leaks the pages.
        unsafe {
            libc::munmap(
                self.base
                    .as_ptr()
                    .add(pages.start * DIRECT_ALIGN_BYTES)
                    .cast(),
                pages.len() * DIRECT_ALIGN_BYTES,
            );
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
mod tests {
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
}
