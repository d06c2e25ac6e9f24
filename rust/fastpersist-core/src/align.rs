//! Page-aligned buffers (the staging pool's slots) and the rounding helpers.
//!
//! The crate's allocator `unsafe` lives here; the page mappings (a load's destination, a large
//! slot's memory), and their `unsafe`, live in [`crate::pages`].

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::pages::{self, HUGE_PAGE_BYTES};
use crate::{DIRECT_ALIGN_BYTES, round_up};

/// A zero-initialised, `DIRECT_ALIGN_BYTES`-aligned byte buffer whose length is a multiple of
/// `DIRECT_ALIGN_BYTES`, so any prefix rounded up to the alignment is a valid O_DIRECT buffer.
///
/// A buffer of at least [`HUGE_PAGE_BYTES`] is its own mapping, starting on a huge-page boundary
/// and advised for transparent huge pages: the kernel can then hand a device one segment per
/// 2 MiB instead of one per 4 KiB page. A virtio disk takes at most 254 segments a request, so
/// a chunk written from 4 KiB pages went out as ~1 MiB requests (1,096 per GiB here) and from
/// huge pages as 4 MiB ones (260 per GiB), which this VM's disk writes faster.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
    /// Whether `ptr` is a mapping of its own (`pages::map_huge_aligned`) rather than the heap's.
    mapped: bool,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Vec<u8>), so moving it between threads or
// sharing `&AlignedBuf` is as safe as for Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: see above; `&AlignedBuf` only gives `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len_bytes` rounded up to the alignment (at least one page).
    ///
    /// # Panics
    /// If the allocation fails (like `Vec`), or the size overflows.
    pub fn zeroed(len_bytes: usize) -> Self {
        let len_bytes = round_up(len_bytes.max(1), DIRECT_ALIGN_BYTES);
        if len_bytes >= HUGE_PAGE_BYTES {
            // A fresh anonymous mapping reads as zeros. Should the kernel refuse it, the heap
            // (glibc maps large blocks too) still gives an aligned buffer.
            if let Ok(ptr) = pages::map_huge_aligned(len_bytes) {
                return AlignedBuf {
                    ptr,
                    len_bytes,
                    mapped: true,
                };
            }
        }
        let layout = Self::layout(len_bytes);
        // SAFETY: `layout` has non-zero size (len_bytes >= one page).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            len_bytes,
            mapped: false,
        }
    }

    fn layout(len_bytes: usize) -> Layout {
        Layout::from_size_align(len_bytes, DIRECT_ALIGN_BYTES).expect("buffer size overflows")
    }

    /// Capacity in bytes (a multiple of the alignment).
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }

    /// Raw pointer for handing to the kernel; valid while `self` is alive and not moved from.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live, initialised (zeroed) allocation of len_bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees unique access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len_bytes) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: ptr is the whole mapping `zeroed` made, owned by self and unmapped once.
            unsafe { pages::unmap_anonymous(self.ptr, self.len_bytes) }
        } else {
            // SAFETY: ptr was allocated in `zeroed` with exactly this layout and is freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len_bytes)) }
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20, (2 << 20) + 4096, 8 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.as_mut_ptr() as usize % DIRECT_ALIGN_BYTES, 0);
            assert!(buf.len_bytes() >= len && buf.len_bytes().is_multiple_of(DIRECT_ALIGN_BYTES));
            assert!(buf.iter().all(|&b| b == 0));
            buf[0] = 7;
            assert_eq!(buf[0], 7);
        }
    }

    #[test]
    fn a_large_buffer_is_its_own_huge_page_mapping() {
        use crate::pages::tests::{advised_huge, smaps_block};
        let mut big = AlignedBuf::zeroed(8 << 20);
        let base = big.as_mut_ptr() as usize;
        assert_eq!(
            base % HUGE_PAGE_BYTES,
            0,
            "not huge-page aligned: {base:#x}"
        );
        big.fill(3);
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        match (thp, smaps_block(base)) {
            (Ok(mode), Some(block)) if !mode.contains("[never]") => {
                assert!(
                    advised_huge(&block),
                    "THP is {mode:?}, slot not advised:\n{block}"
                )
            }
            _ => eprintln!("skipping the THP check: THP is off or smaps is unreadable"),
        }
        let mut small = AlignedBuf::zeroed(HUGE_PAGE_BYTES - DIRECT_ALIGN_BYTES);
        if let Some(block) = smaps_block(small.as_mut_ptr() as usize) {
            assert!(!advised_huge(&block), "{block}");
        }
        drop(big);
        let mut vec = [0u8; 1];
        // SAFETY: mincore on an unmapped page fails with ENOMEM and touches nothing.
        let rc = unsafe { libc::mincore(base as *mut libc::c_void, 4096, vec.as_mut_ptr()) };
        assert_eq!(rc, -1, "a dropped large buffer should be unmapped");
    }
}
