"""The report of a ``fastpersist bench`` run: per-method statistics, speedups over the peers, the
targets it checks, the text table and the PNG chart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .fixed import TARGET_REPLACING_COMMIT_S
from .measure import Row
from .nullsink import TARGET_NULL_SINK_VS_MEMCPY
from .settings import settings_line
from .system import GB, MiB

if TYPE_CHECKING:
    from .harness import Bench

# Targets the table checks: the benchmark issues' (save and load at the drive's limit, the lead over
# peers, flatten+plan of 10,000 tensors under 25 ms).
TARGET_SAVE_VS_LIMIT = 0.90
TARGET_SAVE_VS_SAFETENSORS = 2.0
TARGET_SAVE_VS_TORCH = 3.0
TARGET_TORCH_SAVE_VS_TORCH = 2.0
TARGET_LOAD_VS_LIMIT = 0.90
TARGET_FLATTEN_PLAN_S = 0.025


def _stats(row: Row, nbytes: int) -> dict[str, Any]:
    med, lo, hi = row.median(), min(row.seconds), max(row.seconds)
    out: dict[str, Any] = {
        "label": row.label,
        "kind": row.kind,
        "role": row.role,
        "seconds": row.seconds,
        "median_s": med,
        "min_s": lo,
        "max_s": hi,
        "peak_rss_bytes": row.peak_rss_bytes,
    }
    if row.rate:
        out.update(gb_per_s=nbytes / med / GB, gb_per_s_min=nbytes / hi / GB, gb_per_s_max=nbytes / lo / GB)
    if row.note:
        out["note"] = row.note
    return out


def _speedups(results: dict[str, dict[str, Any]], fp_save: str | None) -> dict[str, float]:
    """fastpersist's save and load time against each peer's (how many times faster)."""
    peers: dict[str, float] = {}
    if fp_save:
        for k, r in results.items():
            if r["role"] == "peer" and r["kind"] == "save":
                peers[f"{fp_save} vs {k}"] = r["median_s"] / results[fp_save]["median_s"]
    if "fastpersist_torch_save" in results and "torch_save" in results:
        peers["fastpersist_torch_save vs torch_save"] = (
            results["torch_save"]["median_s"] / results["fastpersist_torch_save"]["median_s"]
        )
    if "fastpersist_export_hf" in results and "safetensors_save" in results:
        peers["fastpersist_export_hf vs safetensors_save"] = (
            results["safetensors_save"]["median_s"] / results["fastpersist_export_hf"]["median_s"]
        )
    if "fastpersist_load" in results:
        for k, r in results.items():
            if r["role"] == "peer" and r["kind"] == "load":
                peers[f"fastpersist_load vs {k}"] = r["median_s"] / results["fastpersist_load"]["median_s"]
    return peers


def summarise(bench: Bench, extras: dict[str, Any]) -> dict[str, Any]:
    rows = {k: r for k, r in bench.rows.items() if r.seconds}
    results = {k: _stats(r, bench.nbytes) for k, r in rows.items()}
    # The drive's limit is its best: the fastest limit row, not the one at the save's (or the
    # load's) own settings, which can flatter them (this VM's disk: 3.1 GB/s with 64 MiB writes,
    # 1.8 GB/s with 8 MiB ones). Writes: the engine at the save's settings, at 64 MiB x 2, and fio;
    # reads: the engine into warm memory at both settings and into fresh memory (with the read
    # job's prefault thread the last can be the fastest).
    write_ref = fastest_limit(results, "save", "write_limit_engine")
    read_ref = fastest_limit(results, "load", "read_limit_engine")
    for r in results.values():
        ref = write_ref if r["kind"] == "save" else read_ref
        if "gb_per_s" in r and ref in results:
            r["ratio_to_limit"] = r["gb_per_s"] / results[ref]["gb_per_s"]
    fp_save = next((k for k in ("fastpersist_save_io_uring", "fastpersist_save_threads") if k in results), None)
    return {
        "results": results,
        "write_limit": write_ref,
        "read_limit": read_ref,
        "speedups": _speedups(results, fp_save),
        "targets": _targets(results, fp_save, write_ref, read_ref, extras),
        "fastpersist_save": fp_save,
    }


def fastest_limit(results: dict[str, dict[str, Any]], kind: str, default: str) -> str:
    """The key of the `kind` ("save" or "load") limit row with the lowest median, else `default`."""
    limits = [k for k, r in results.items() if r["kind"] == kind and r["role"] == "limit"]
    return min(limits, key=lambda k: results[k]["median_s"]) if limits else default


def _targets(
    results: dict[str, Any], fp_save: str | None, write_ref: str, read_ref: str, extras: dict[str, Any]
) -> list[dict[str, Any]]:
    """Each target of the benchmark checked against this run's medians."""
    targets: list[dict[str, Any]] = []

    def target(key: str, name: str, value: float | None, threshold: float, higher: bool = True) -> None:
        ok = None if value is None else (value >= threshold if higher else value < threshold)
        targets.append({"key": key, "name": name, "value": value, "threshold": threshold, "ok": ok})

    def speedup(a: str | None, b: str) -> float | None:
        return results[b]["median_s"] / results[a]["median_s"] if a and a in results and b in results else None

    target(
        "save_vs_limit",
        f"save >= {TARGET_SAVE_VS_LIMIT}x write limit ({results.get(write_ref, {}).get('label', write_ref)})",
        results[fp_save].get("ratio_to_limit") if fp_save else None,
        TARGET_SAVE_VS_LIMIT,
    )
    if fp_save and "write_limit_engine" in results and write_ref != "write_limit_engine":
        engine_ratio = results[fp_save]["gb_per_s"] / results["write_limit_engine"]["gb_per_s"]
        target(
            "save_vs_engine",
            f"save >= {TARGET_SAVE_VS_LIMIT}x write limit (engine raw at the save's settings)",
            engine_ratio,
            TARGET_SAVE_VS_LIMIT,
        )
    target(
        "save_vs_safetensors",
        f"save >= {TARGET_SAVE_VS_SAFETENSORS}x safetensors",
        speedup(fp_save, "safetensors_save"),
        TARGET_SAVE_VS_SAFETENSORS,
    )
    target(
        "save_vs_torch",
        f"save >= {TARGET_SAVE_VS_TORCH}x torch.save",
        speedup(fp_save, "torch_save"),
        TARGET_SAVE_VS_TORCH,
    )
    target(
        "torch_save_vs_torch",
        f"torch_save >= {TARGET_TORCH_SAVE_VS_TORCH}x torch.save",
        speedup("fastpersist_torch_save", "torch_save"),
        TARGET_TORCH_SAVE_VS_TORCH,
    )
    target(
        "load_vs_limit",
        f"cold load >= {TARGET_LOAD_VS_LIMIT}x read limit ({results.get(read_ref, {}).get('label', read_ref)})",
        results.get("fastpersist_load", {}).get("ratio_to_limit"),
        TARGET_LOAD_VS_LIMIT,
    )
    target("load_vs_torch", "load faster than torch.load", speedup("fastpersist_load", "torch_load"), 1.0)
    st_loads = [k for k in ("safetensors_load_mmap", "safetensors_load_pread") if k in results]
    st_best = min(st_loads, key=lambda k: results[k]["median_s"]) if st_loads else "safetensors_load_mmap"
    target(
        "load_vs_safetensors",
        f"load faster than safetensors (fastest: {st_best})",
        speedup("fastpersist_load", st_best),
        1.0,
    )
    _probe_targets(extras, target)
    return targets


def _probe_targets(extras: dict[str, Any], target: Callable[..., None]) -> None:
    """The targets of the probes run outside the timed methods (flatten, fixed costs, RSS)."""
    fplan = extras.get("flatten_plan", {})
    median_ms = fplan["median_s"] * 1000 if "median_s" in fplan else None
    target(
        "flatten_plan",
        f"flatten+plan of {fplan.get('tensors', 10_000)} tensors < {TARGET_FLATTEN_PLAN_S * 1000:.0f} ms (ms)",
        median_ms,
        TARGET_FLATTEN_PLAN_S * 1000,
        higher=False,
    )
    commit = extras.get("replacing", {}).get("median", {}).get("commit")
    target(
        "replacing_commit",
        f"commit of a replacing save <= {TARGET_REPLACING_COMMIT_S * 1000:.0f} ms (ms)",
        None if commit is None else commit * 1000,
        TARGET_REPLACING_COMMIT_S * 1000 + 1e-9,
        higher=False,
    )
    null_sink = extras.get("null_sink", {})
    target(
        "null_sink",
        f"save into the null sink >= {TARGET_NULL_SINK_VS_MEMCPY}x a warm memcpy of the same bytes",
        null_sink.get("ratio"),
        TARGET_NULL_SINK_VS_MEMCPY,
    )
    rss = extras.get("rss", {})
    if "delta_bytes" in rss:
        target(
            "rss",
            "bounded save peak RSS delta <= pool_bytes + 64 MiB (MiB)",
            rss["delta_bytes"] / MiB,
            rss["budget_bytes"] / MiB + 1e-9,
            higher=False,
        )


def table(report: dict[str, Any]) -> str:
    results = report["results"]
    lines: list[str] = []
    state = report["state"]
    lines.append(
        f"fastpersist bench: {state['bytes'] / 2**30:.2f} GiB state ({state['params'] / 1e6:.1f} M params, "
        f"{state['tensors']} tensors), {report['config']['reps']} reps, dirs {', '.join(report['config']['dirs'])} "
        f"[{'; '.join(report['machine']['filesystems'])}]"
    )
    config = report["config"]
    if "settings_source" in config:
        lines.append(settings_line(config))
    width = max([50] + [len(r["label"]) + 1 for r in results.values()])
    head = f"{'method':<{width}}{'median s':>9}{'min s':>8}{'max s':>8}{'GB/s':>8}{'x limit':>9}"
    for kind, title in (
        ("save", "SAVE (durable: fsync included)"),
        ("load", "LOAD (cold)" if report["cold_reads"] else "LOAD (page cache NOT dropped)"),
    ):
        lines += ["", title, head, "-" * len(head)]
        for r in results.values():
            if r["kind"] != kind:
                continue
            gbs = f"{r['gb_per_s']:8.2f}" if "gb_per_s" in r else f"{'-':>8}"
            ratio = f"{r['ratio_to_limit']:8.2f}x" if "ratio_to_limit" in r else f"{'-':>9}"
            lines.append(f"{r['label']:<{width}}{r['median_s']:9.3f}{r['min_s']:8.3f}{r['max_s']:8.3f}{gbs}{ratio}")
    lines += [
        "",
        f"x limit: GB/s over the fastest limit row, {results.get(report['write_limit'], {}).get('label', '-')} "
        f"(saves) and {results.get(report['read_limit'], {}).get('label', '-')} (loads), medians",
    ]
    phases = report.get("save_phases", {})
    if phases:
        lines += ["", "WHERE A SAVE'S TIME GOES (SaveResult.phases, median s; staging overlaps write_fsync)"]
        for key, medians in phases.items():
            shown = ", ".join(f"{name} {value:.3f}" for name, value in medians.items())
            lines.append(f"  {results.get(key, {}).get('label', key):<36} {shown}")
    for key, medians in report.get("load_phases", {}).items():
        lines += ["", "WHERE A LOAD'S TIME GOES (fp.load(phases=...), median s; crc32c is inside read)"]
        timed = ", ".join(f"{name} {value:.3f}" for name, value in medians.items() if not name.startswith("read_"))
        lines.append(f"  {results.get(key, {}).get('label', key):<36} {timed}")
        if "read_minor_faults" in medians:
            lines.append(
                f"  {'':<36} first touch inside read: {medians['read_minor_faults']:.0f} page faults, "
                f"{medians['read_sys_cpu_s']:.3f} s system CPU"
            )
    if report["speedups"]:
        lines += ["", "SPEEDUPS (peer median s / fastpersist median s)"]
        for name, value in report["speedups"].items():
            a, b = name.split(" vs ")
            lines.append(f"  {results[a]['label']:<28} vs {results[b]['label']:<46} {value:6.2f}x")
    lines += ["", *_probe_lines(report)]
    lines += ["", "TARGETS"]
    for t in report["targets"]:
        verdict = "n/a " if t["ok"] is None else ("ok  " if t["ok"] else "MISS")
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"  [{verdict}] {t['name']}: {value} (threshold {t['threshold']:g})")
        if t["ok"] is False:
            lines.append(f"         bound: {miss_bound(t['key'], report)}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _probe_lines(report: dict[str, Any]) -> list[str]:
    """The probes run outside the timed methods: flatten+plan, the null sink, peak RSS."""
    fplan, rss = report.get("flatten_plan", {}), report.get("rss", {})
    lines: list[str] = []
    if fplan:
        lines.append(flatten_plan_line(fplan))
    null_sink = report.get("null_sink", {})
    if "ratio" in null_sink:
        lines.append(null_sink_line(null_sink))
    if "delta_bytes" in rss:
        lines.append(
            f"peak RSS added by a {rss['mode']} fastpersist.save (pool {rss['pool_bytes'] / MiB:.0f} MiB, "
            "fresh process): "
            f"{rss['delta_bytes'] / MiB:.1f} MiB (budget {rss['budget_bytes'] / MiB:.0f} MiB = pool + 64 MiB"
            f"{'' if rss['hwm_reset'] else '; VmHWM could not be reset'})"
        )
    elif rss:
        lines.append(f"peak RSS probe failed: {rss.get('error', '?')}")
    lines.append(
        f"peak RSS of this benchmark process: {report['peak_rss_bytes'] / 2**30:.2f} GiB (the state, the "
        "engine-limit buffer of the same size, and what one method holds at a time)"
    )
    return lines


def flatten_plan_line(fplan: dict[str, Any]) -> str:
    """The flatten+plan probe in one line, with the Python walk's median where it was timed too."""
    walk = fplan.get("walk", "python")
    line = (
        f"flatten+plan of {fplan['tensors']} tensors ({walk} walk): median {fplan['median_s'] * 1000:.1f} ms "
        f"(min {fplan['min_s'] * 1000:.1f}, max {fplan['max_s'] * 1000:.1f}, {fplan['runs']} runs; "
        f"CPU median {fplan['cpu_median_s'] * 1000:.1f} ms)"
    )
    if "python_median_s" in fplan:
        line += (
            f"; the Python walk interleaved: median {fplan['python_median_s'] * 1000:.1f} ms "
            f"({fplan['python_median_s'] / fplan['median_s']:.2f}x)"
        )
    if "attribute_reads_median_s" in fplan:
        reads_ms = fplan["attribute_reads_median_s"] * 1000
        line += f"; torch's attribute reads alone, in a bare Python loop: {reads_ms:.1f} ms"
    return line


def miss_bound(key: str, report: dict[str, Any]) -> str:
    """What bounds a missed target, from the phases and rows of the same run."""
    results = report["results"]
    save_key, limit = report.get("fastpersist_save"), results.get(report["write_limit"], {})
    if key.startswith("save_") and save_key in report.get("save_phases", {}):
        p, total = report["save_phases"][save_key], results[save_key]["median_s"]
        text = (
            f"write_fsync {p['write_fsync']:.3f} s of the save's {total:.3f} s (the drive: data writes and fsync; "
            f"staging {p['staging']:.3f} s overlaps them), flatten_plan {p['flatten_plan']:.3f} s, "
            f"commit {p['commit']:.3f} s"
        )
        peer = {"save_vs_safetensors": "safetensors_save", "save_vs_torch": "torch_save"}.get(key)
        if peer in results and "median_s" in limit:
            cap = results[peer]["median_s"] / limit["median_s"]
            text += f"; at the drive's limit ({limit['label']}) the ratio would be {cap:.2f}x"
        own = results.get("write_limit_engine", {})
        if key == "save_vs_limit" and report["write_limit"] != "write_limit_engine" and "median_s" in own:
            text += (
                f"; the save's settings bound it: the drive itself writes at them in {own['median_s']:.3f} s "
                f"({own['label']}) against {limit['median_s']:.3f} s at the best row: rerun `fastpersist tune` "
                "on a quiet machine, or set Config(chunk_bytes=..., queue_depth=...)"
            )
        return text
    if key == "torch_save_vs_torch" and "fastpersist_torch_save" in results and "median_s" in limit:
        own, peer = results["fastpersist_torch_save"]["median_s"], results.get("torch_save", {}).get("median_s")
        text = (
            f"the drive: fp.torch_save took {own:.3f} s against {limit['median_s']:.3f} s for the drive's "
            f"best write of the same bytes ({limit['label']})"
        )
        if peer is not None:
            text += f"; at that limit the ratio would be {peer / limit['median_s']:.2f}x"
        return text
    if key == "load_vs_limit" and "fastpersist_load" in report.get("load_phases", {}):
        p, total = report["load_phases"]["fastpersist_load"], results["fastpersist_load"]["median_s"]
        fresh = results.get("read_fresh_engine", {}).get("median_s")
        fresh_text = f" (the engine into fresh memory: {fresh:.3f} s)" if fresh is not None else ""
        return (
            f"read {p['read']:.3f} s of the load's {total:.3f} s{fresh_text}: first touch of fresh memory "
            f"{p.get('read_minor_faults', 0):.0f} page faults, {p.get('read_sys_cpu_s', 0):.3f} s system CPU; "
            f"crc32c {p.get('crc32c', 0):.3f} s; build {p.get('build', 0):.3f} s, "
            f"unflatten {p.get('unflatten', 0):.3f} s"
        )
    if key == "flatten_plan" and "median_s" in report.get("flatten_plan", {}):
        fplan = report["flatten_plan"]
        count = max(fplan["tensors"], 1)
        walk = fplan.get("walk", "python")
        return (
            f"the {walk} walk of the state, {fplan['median_s'] / count * 1e6:.1f} us per tensor, "
            f"of which reading the 17 torch attributes the Python walk reads takes "
            f"{fplan['attribute_reads_median_s'] / count * 1e6:.1f} us in a bare loop (planning is ~0.2 ms): see "
            "docs/performance.md"
        )
    if key == "replacing_commit" and "median" in report.get("replacing", {}):
        p = report["replacing"]["median"]
        return (
            f"the commit (manifest write and fsync, the exchange, the parent's fsync) of a save of "
            f"{report['replacing']['bytes'] / MiB:.0f} MiB whose staging took {p['staging']:.3f} s and "
            f"write_fsync {p['write_fsync']:.3f} s: fsyncs on a busy disk"
        )
    if key == "null_sink" and "phases" in report.get("null_sink", {}):
        n = report["null_sink"]
        return (
            "staging (one pass of copy and crc32c into the pool, on one thread) "
            f"{n['phases']['staging']:.3f} s of {n['null_sink_s']:.3f} s, flatten_plan "
            f"{n['phases']['flatten_plan']:.3f} s; memcpy of {n['bytes'] / 2**30:.2f} GiB {n['memcpy_s']:.3f} s "
            "(glibc's non-temporal path, which copies into pool slots do not take): see docs/performance.md"
        )
    if key == "rss" and "async_early_copy_bytes" in report.get("rss", {}):
        r = report["rss"]
        left = r["budget_bytes"] - r["pool_bytes"]
        return (
            f"the pool ({r['pool_bytes'] / MiB:.0f} MiB: all of its slots are touched when the drive falls behind "
            f"the staging) leaves {left / MiB:.1f} MiB of the budget for the rest (threads, the manifest, Python "
            f"objects); RSS kept after the save {(r['rss_after_bytes'] - r['rss_before_bytes']) / MiB:.1f} MiB. "
            f"(A save_async also holds its early copy of the {r['async_early_copy_tensors']} tensors <= 1 MiB, "
            f"{r['async_early_copy_bytes'] / MiB:.1f} MiB: docs/overlap.md)"
        )
    return "no phase measured for it in this run"


def null_sink_line(n: dict[str, Any]) -> str:
    """The null-sink probe in one line: the save's speed against memcpy's."""
    return (
        f"save into the null sink ({n['bytes'] / 2**30:.2f} GiB): "
        f"median {n['null_sink_s']:.3f} s = {n['null_sink_gb_per_s']:.2f} GB/s; warm memcpy {n['memcpy_s']:.3f} s "
        f"= {n['memcpy_gb_per_s']:.2f} GB/s; ratio {n['ratio']:.2f}x ({n['runs']} runs each, interleaved)"
    )


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    colors = {"limit": "#8c8c8c", "fastpersist": "#1f77b4", "peer": "#ff7f0e"}
    groups = [(k, [r for r in results.values() if r["kind"] == k and "gb_per_s" in r]) for k in ("save", "load")]
    heights = [max(len(rows), 1) for _k, rows in groups]
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.45 * max(heights) + 2.2), squeeze=False)
    xmax = max((r["gb_per_s_max"] for _k, rows in groups for r in rows), default=1.0) * 1.18
    for ax, (kind, rows) in zip(axes[0], groups, strict=True):
        rows = rows[::-1]
        y = list(range(len(rows)))
        med = [r["gb_per_s"] for r in rows]
        err = [[r["gb_per_s"] - r["gb_per_s_min"] for r in rows], [r["gb_per_s_max"] - r["gb_per_s"] for r in rows]]
        ax.barh(y, med, xerr=err, color=[colors[r["role"]] for r in rows], capsize=3, height=0.7)
        for yi, r in zip(y, rows, strict=True):
            ax.text(r["gb_per_s_max"] + xmax * 0.01, yi, f"{r['gb_per_s']:.2f}", va="center", fontsize=8)
        ax.set_yticks(y, [r["label"] for r in rows], fontsize=8)
        ax.set_xlim(0, xmax)
        ax.set_xlabel("GB/s (median; bars: min-max)")
        title = "save (durable)" if kind == "save" else ("load (cold)" if report["cold_reads"] else "load (warm)")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    state = report["state"]
    fig.suptitle(
        f"fastpersist bench: {state['bytes'] / 2**30:.2f} GiB training state, {state['tensors']} tensors, "
        f"{report['config']['reps']} reps; grey = drive limit, blue = fastpersist, orange = peers",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
