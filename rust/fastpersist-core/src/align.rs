//! Page-aligned heap buffers (the staging pool's slots) and the rounding helpers.
//!
//! The crate's allocator `unsafe` lives here; the shared page mappings a load reads into, and
//! their `unsafe`, live in [`crate::pages`].

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::DIRECT_ALIGN_BYTES;

/// A zero-initialised, `DIRECT_ALIGN_BYTES`-aligned byte buffer whose length is a multiple of
/// `DIRECT_ALIGN_BYTES`, so any prefix rounded up to the alignment is a valid O_DIRECT buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len_bytes: usize,
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
        let layout = Self::layout(len_bytes);
        // SAFETY: `layout` has non-zero size (len_bytes >= one page).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len_bytes }
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
        // SAFETY: ptr was allocated in `zeroed` with exactly this layout and is freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len_bytes)) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two).
pub fn round_up(value: usize, align: usize) -> usize {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

/// `round_up` for file offsets.
pub fn round_up_u64(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.as_mut_ptr() as usize % DIRECT_ALIGN_BYTES, 0);
            assert!(buf.len_bytes() >= len && buf.len_bytes().is_multiple_of(DIRECT_ALIGN_BYTES));
            assert!(buf.iter().all(|&b| b == 0));
            buf[0] = 7;
            assert_eq!(buf[0], 7);
        }
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(0, 4096), 0);
        assert_eq!(round_up(1, 4096), 4096);
        assert_eq!(round_up(4096, 4096), 4096);
        assert_eq!(round_up_u64(4097, 64), 4160);
    }
}
