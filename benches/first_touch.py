"""How fast fresh anonymous memory can be faulted in here: the cost every load pays on top of
the drive when it reads into new memory (see docs/performance.md, "What bounds each phase").

Each method maps ``--size`` of fresh memory, faults it in, and reports wall time, minor faults
and system CPU; a second ``memset`` of the same memory shows the cost once the pages exist.

Run: ``python benches/first_touch.py --size 1GiB --reps 2``.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import threading
import time

from fastpersist.tools.units import parse_size

libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

PROT_READ_WRITE = 0x3
MAP_PRIVATE_ANONYMOUS = 0x22
MAP_POPULATE = 0x8000
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_POPULATE_WRITE = 14, 15, 23


def run(label: str, nbytes: int, *, flags: int = 0, advice: tuple[int, ...] = (), touch_threads: int = 1) -> None:
    """Maps `nbytes`, applies `advice`, touches every page with `touch_threads` memsets; prints."""
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    addr = libc.mmap(None, nbytes, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS | flags, -1, 0)
    for a in advice:
        if libc.madvise(addr, nbytes, a) != 0:
            print(f"{label}: madvise({a}) failed, errno {ctypes.get_errno()}")
    step = nbytes // touch_threads
    threads = [threading.Thread(target=libc.memset, args=(addr + i * step, 1, step)) for i in range(touch_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    libc.memset(addr, 2, nbytes)
    warm = time.perf_counter() - first
    libc.munmap(addr, nbytes)
    print(
        f"{label:<44} faulted in + touched {first - start:6.3f} s  (minor faults {after.ru_minflt - before.ru_minflt}, "
        f"system CPU {after.ru_stime - before.ru_stime:.3f} s)  warm memset {warm:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    n = args.size
    for _ in range(args.reps):
        run("touch, 4 KiB pages, one thread", n, advice=(MADV_NOHUGEPAGE,))
        run("touch, 4 KiB pages, two threads", n, advice=(MADV_NOHUGEPAGE,), touch_threads=2)
        run("MAP_POPULATE", n, flags=MAP_POPULATE, advice=())
        run("MADV_POPULATE_WRITE, 4 KiB pages", n, advice=(MADV_NOHUGEPAGE, MADV_POPULATE_WRITE))
        run("huge pages + MADV_POPULATE_WRITE", n, advice=(MADV_HUGEPAGE, MADV_POPULATE_WRITE))
        run("huge pages, touch", n, advice=(MADV_HUGEPAGE,))


if __name__ == "__main__":
    main()
