"""The rules of the package layout, checked from the source (docs/architecture.md)."""

from __future__ import annotations

import ast
import inspect
import os
import pathlib
import re
import shutil
import subprocess

import fastpersist

PACKAGE = pathlib.Path(fastpersist.__file__).parent
REPO = pathlib.Path(__file__).resolve().parent.parent
RUST = REPO / "rust"
TOOLS = "fastpersist.tools"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere (function-level and TYPE_CHECKING included)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastpersist"):
                base = node.module or ""
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in mods or alias.name == "_core" else base
                if target in mods and target != mod:
                    edges[mod].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    assert _cycles(_imports(_modules())) == []


def test_below_the_tools_the_package_root_gives_only_core() -> None:
    """The import-linter contracts skip imports of the package itself: the linter reads only
    ``.py`` files, so ``import fastpersist._core as _core`` (an extension module) reads as one.
    So no module below the command line may take anything else from the package root."""
    taken = {}
    for mod, path in _modules().items():
        if mod.startswith(TOOLS) or mod in ("fastpersist", "fastpersist.__main__"):
            continue
        depth = mod.count(".") + (path.name == "__init__.py")
        for node in ast.walk(ast.parse(path.read_text())):
            root = (isinstance(node, ast.ImportFrom) and node.level == depth and not node.module) or (
                isinstance(node, ast.ImportFrom) and node.module == "fastpersist"
            )
            names = [a.name for a in node.names] if root and isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == "fastpersist"]
            if [n for n in names if n != "_core"]:
                taken[mod] = names
    assert taken == {}


#: The engine's entrances that only its front door (engine/) calls.
ENGINE_CALLS = ("start_write", "read_ranges_into")


def test_only_the_engine_front_door_starts_writes_and_reads() -> None:
    calls = {
        mod: sorted(
            node.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute)
            and node.attr in ENGINE_CALLS
            and isinstance(node.value, ast.Name)
            and node.value.id == "_core"
        )
        for mod, path in _modules().items()
        if not mod.startswith("fastpersist.engine")
    }
    assert {m: c for m, c in calls.items() if c} == {}


#: Raw writes and O_DIRECT, which part files leave to the engine (engine.PartFile, start_write).
RAW_WRITES = ("pwrite", "pwritev", "O_DIRECT")
#: Files that are not part files, written with a raw call, and why.
RAW_WRITERS = {
    # a safetensors shard for Hugging Face tools: each tensor lands at its own offset as it arrives
    "fastpersist.interop.hfshards": ["pwrite"],
}


def test_only_the_engine_writes_part_files_raw_or_opens_with_o_direct() -> None:
    raw = {
        mod: sorted(
            node.attr
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in RAW_WRITES
        )
        for mod, path in _modules().items()
        if not mod.startswith("fastpersist.engine")
    }
    assert {m: c for m, c in raw.items() if c} == RAW_WRITERS


def _lint_imports(python_dir: pathlib.Path, config: pathlib.Path) -> subprocess.CompletedProcess[str]:
    command = shutil.which("lint-imports")
    assert command, "lint-imports is missing: pip install '.[test]' installs import-linter"
    env = {**os.environ, "PYTHONPATH": str(python_dir)}
    return subprocess.run(
        [command, "--config", str(config), "--no-cache", "--no-logo"],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contracts_hold() -> None:
    """docs/architecture.md's layers, as pyproject.toml's import-linter contracts."""
    run = _lint_imports(REPO / "python", REPO / "pyproject.toml")
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_contracts_catch_a_planted_loop(tmp_path: pathlib.Path) -> None:
    """The old distributed <-> levels loop, planted again in a copy: the layers contract breaks."""
    shutil.copytree(REPO / "python" / "fastpersist", tmp_path / "python" / "fastpersist", ignore=_not_source)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    control = tmp_path / "python" / "fastpersist" / "distributed" / "control.py"
    control.write_text(control.read_text() + "\nfrom ..levels.partner_holdings import Share  # planted\n")
    run = _lint_imports(tmp_path / "python", tmp_path / "pyproject.toml")
    assert run.returncode != 0
    assert "fastpersist.distributed.control -> fastpersist.levels.partner_holdings" in run.stdout, run.stdout


def _not_source(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".py") and not os.path.isdir(os.path.join(directory, n))]


def test_files_and_functions_stay_small() -> None:
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}:{node.name}: {length} lines")
    assert too_long == []


_RUST_FN = re.compile(r"\bfn\s+(\w+)")
#: What the brace counter skips: comments, strings (plain and raw) and char literals (not lifetimes).
_RUST_SKIPPED = re.compile(
    r"//[^\n]*|/\*.*?\*/|r(#*)\".*?\"\1|b?\"(?:\\.|[^\"\\])*\"|b?'(?:\\.[^']*|[^'\\\n])'",
    re.DOTALL,
)


def _rust_function_lengths(source: str) -> list[tuple[str, int]]:
    """``(name, lines from `fn` to its closing brace)`` of every Rust function with a body."""
    code = _RUST_SKIPPED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), source)
    lengths = []
    for match in _RUST_FN.finditer(code):
        opening = code.find("{", match.end())
        if opening < 0 or ";" in code[match.end() : opening]:
            continue  # a declaration without a body (trait method, extern)
        depth, at = 0, opening
        for at in range(opening, len(code)):
            depth += {"{": 1, "}": -1}.get(code[at], 0)
            if depth == 0:
                break
        lengths.append((match.group(1), code.count("\n", match.start(), at) + 1))
    return lengths


def test_rust_function_lengths_are_measured_from_the_source() -> None:
    source = (
        'fn short() -> &\'static str {\n    "}}}"\n}\n'
        "trait T {\n    fn declared(&self);\n}\n"
        "fn longer<'a>(x: &'a u8) {\n    let c = '{';\n    // }\n    let _ = (x, c);\n}\n"
    )
    assert _rust_function_lengths(source) == [("short", 3), ("longer", 5)]


def test_rust_files_and_functions_stay_small() -> None:
    """The Python rule for Rust too (clippy's too_many_lines enforces the function limit, counting
    code lines only; this counts every line, as for Python)."""
    paths = sorted(RUST.glob("*/src/**/*.rs")) + sorted(RUST.glob("*/tests/*.rs")) + sorted(RUST.glob("*/benches/*.rs"))
    assert paths, f"no Rust sources under {RUST}"
    too_long = []
    for path in paths:
        source = path.read_text()
        name = path.relative_to(RUST)
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        too_long += [
            f"{name}:{fn}: {length} lines"
            for fn, length in _rust_function_lengths(source)
            if length > MAX_FUNCTION_LINES
        ]
    assert too_long == []


FORMAT = "fastpersist.format"
#: Pieces of on-disk names and their patterns; only format/ may spell them (format/layout.py owns them).
ON_DISK_NAMES = (
    ".fptmp",
    ".fpstripe",
    ".fpowner",
    ".fpremoving",
    ".fpdcp",
    "manifest.json",
    "latest.json",
    "history.json",
    ".metadata",
    "data-w",
    ".tmp-",
)
#: A step directory ("step-00000120", f"step-{step:08d}", r"^step-(\d{8,})$"), not a CLI flag like --step-seconds.
STEP_DIR = re.compile(r"(?<![\w-])step-(?:\d|\(|$)")
#: A shard directory ("shard-00001", f"shard-{rank:05d}", r"^shard-\d{5}$"), not a flag like --max-shard-size.
SHARD_DIR = re.compile(r"(?<![\w-])shard-(?:\d|\\|$)")


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _spelled_names(source: str) -> list[str]:
    """The string literals (f-string pieces included, docstrings and comments not) that spell an on-disk name."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if (
                any(name in node.value for name in ON_DISK_NAMES)
                or STEP_DIR.search(node.value)
                or SHARD_DIR.search(node.value)
            ):
                hits.append(f"line {node.lineno}: {node.value!r}")
    return hits


def test_the_check_sees_names_in_literals_fstrings_and_regexes_but_not_docstrings() -> None:
    source = (
        '"""Writes manifest.json."""\nA = f"step-{s:08d}"\nB = re.compile(r"^\\.(.+)\\.fptmp-")\nC = "--step-seconds"\n'
        'D = f"shard-{r:05d}"\nE = re.compile(r"^shard-\\d{5}$")\nF = "--max-shard-size"\n'
    )
    assert [hit.split(":")[0] for hit in _spelled_names(source)] == ["line 2", "line 3", "line 5", "line 6"]


def test_only_format_spells_an_on_disk_name() -> None:
    spelled = {
        mod: hits
        for mod, path in _modules().items()
        if not mod.startswith(FORMAT) and (hits := _spelled_names(path.read_text()))
    }
    assert spelled == {}


def test_api_holds_only_the_public_entry_points() -> None:
    tree = ast.parse((PACKAGE / "api.py").read_text())
    defined = sorted(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert defined == sorted(fastpersist.api.__all__)


ARCHITECTURE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "architecture.md"
#: The folders whose every module the architecture's module map names (tools/bench/ is one entry).
LISTED_FOLDERS = (
    "",
    "engine",
    "gpu",
    "format",
    "tuning",
    "saving",
    "memory_level",
    "loading",
    "levels",
    "distributed",
    "interop",
    "integrations",
    "advisor",
    "tools",
)


def _module_map() -> dict[str, str]:
    """The module map of docs/architecture.md under python/fastpersist/: folder ("" for the top) -> its text."""
    block = ARCHITECTURE.read_text().split("## Module map", 1)[1].split("```")[1]
    package = block.split("python/fastpersist/\n", 1)[1].split("\ntests/", 1)[0]
    entries: dict[str, str] = {}
    folder = ""
    for line in package.splitlines():
        label = line[2:].split(" ", 1)[0] if line.startswith("  ") and not line.startswith("   ") else ""
        if label.endswith("/"):
            folder = label.rstrip("/")
        entries[folder] = entries.get(folder, "") + " " + line
    return entries


def test_the_module_map_names_every_module() -> None:
    entries = _module_map()
    assert sorted(entries) == sorted(LISTED_FOLDERS)
    missing = []
    for folder in LISTED_FOLDERS:
        for path in sorted((PACKAGE / folder).glob("*.py")):
            if path.stem not in ("__init__", "__main__") and not re.search(rf"\b{path.stem}\b", entries[folder]):
                missing.append(f"{folder or 'fastpersist'}/{path.name}")
    assert missing == []


def test_every_folder_of_the_package_is_in_the_module_map() -> None:
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(folders - set(LISTED_FOLDERS)) == []


def test_the_write_request_has_one_field_list_in_python_the_stub_and_the_binding() -> None:
    # The request crosses into Rust by attribute name: a field added to one of the three and not
    # the others fails only at run time, on the path that sets it. Each record of the request
    # (Python dataclass = stub protocol = binding struct) is checked, and each nests the same.
    import dataclasses

    from fastpersist import engine

    binding_structs = {
        "WriteRequest": "WriteRequest<'py>",
        "WriteOptions": "WriteOptionsAttrs",
        "JobHooks": "JobHooksAttrs<'py>",
        "Guard": "GuardAttrs",
    }
    stub = ast.parse((REPO / "python" / "fastpersist" / "_core.pyi").read_text())
    binding = (REPO / "rust" / "fastpersist-py" / "src" / "write.rs").read_text()
    for name, struct_name in binding_structs.items():
        dataclass_fields = {f.name for f in dataclasses.fields(getattr(engine, name))}
        protocol = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == name)
        stub_fields = {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
        struct = binding.split(f"pub(crate) struct {struct_name} {{", 1)[1].split("\n}", 1)[0]
        binding_fields = set(re.findall(r"^\s+(\w+):", struct, re.M))
        assert dataclass_fields == stub_fields == binding_fields, (name, dataclass_fields, stub_fields, binding_fields)
    # The nesting: the request holds options and hooks, the hooks hold the guard.
    assert "options: WriteOptionsAttrs" in binding and "hooks: JobHooksAttrs<'py>" in binding
    assert "guard: Option<GuardAttrs>" in binding


def test_a_save_job_is_given_its_settings_when_made_not_after() -> None:
    # Settings assigned from outside after construction (four modules did) are a second place
    # where a job's rule lives; SaveJob's constructor takes them all.
    from fastpersist.saving.job import SaveJob

    settings = set(inspect.signature(SaveJob).parameters) - {"path", "config"}
    late = {
        f"{mod}:{node.lineno}"
        for mod, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
        and target.attr in settings
        and not (isinstance(target.value, ast.Name) and target.value.id == "self")
    }
    assert late == set()


def test_the_tests_mirror_the_package_and_their_helpers_live_in_one_folder() -> None:
    tests = REPO / "tests"
    package_folders = {p.parent.name for p in (REPO / "python" / "fastpersist").glob("*/__init__.py")}
    test_folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert test_folders == package_folders | {"helpers"}
    loose = [
        str(p.relative_to(tests))
        for p in tests.rglob("*.py")
        if "helpers" not in p.parts and p.name != "conftest.py" and not p.name.startswith("test_")
    ]
    assert loose == []  # a helper outside tests/helpers/ is found only by chance
    assert list((tests / "helpers").glob("test_*.py")) == []
    # ruff sorts the helpers' imports as local ones only if pyproject.toml names each of them
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["isort"]["known-local-folder"]
    )
    assert listed == {p.stem for p in (tests / "helpers").glob("*.py")}


def test_no_two_modules_share_a_name() -> None:
    """A name says which module it is without its folder (two ``identity.py`` needed a map)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    rust = REPO / "rust"
    for path in rust.glob("*/src/**/*.rs"):
        if path.stem not in ("lib", "mod", "main"):
            seen.setdefault(f"{path.parts[len(rust.parts)]}:{path.stem}", []).append(str(path.relative_to(rust)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def _checkpointer_privates() -> set[str]:
    """The private attributes and methods a Checkpointer defines (``self._x = ...``, ``def _x``)."""
    tree = ast.parse((PACKAGE / "checkpointer.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    for node in ast.walk(cls):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        for t in (
            [target] if target is not None else getattr(node, "targets", []) if isinstance(node, ast.Assign) else []
        ):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_a_checkpointer_private_and_the_levels_see_a_typed_host() -> None:
    privates = _checkpointer_privates()
    assert {"_root", "_copies", "_lock"} <= privates  # the scan sees them
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "checkpointer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # Another object's attribute of a Checkpointer-private name, read from outside it.
            if isinstance(node, ast.Attribute) and node.attr in privates:
                base = node.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert found == [], "reads of a Checkpointer private outside checkpointer.py (add to levels/host.py's LevelHost)"
    untyped = []
    for path in sorted((PACKAGE / "levels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and node.arg in ("ck", "host", "checkpointer"):
                if node.annotation is None or ast.unparse(node.annotation) != "LevelHost":
                    untyped.append(
                        f"levels/{path.name}:{node.lineno}: {node.arg}: {ast.unparse(node.annotation or node)}"
                    )
    assert untyped == [], "the levels take the Checkpointer as a LevelHost (levels/host.py), never Any"


_RUST_MOD = re.compile(r"^\s*(?:#\[cfg\(test\)\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.MULTILINE)


def _unnamed(doc: str, modules: list[str]) -> list[str]:
    """The modules that `doc` does not name as a whole word."""
    return sorted(m for m in modules if not re.search(rf"\b{re.escape(m)}\b", doc))


def test_each_folder_doc_names_its_modules() -> None:
    """A folder's docstring (Python) or ``//!`` doc of its ``mod.rs`` (Rust) is a map of it: it names every module."""
    missing = {}
    for init in sorted(PACKAGE.rglob("__init__.py")):
        folder = init.parent
        if folder == PACKAGE:
            continue  # the package's docstring is its public summary; docs/architecture.md maps the top modules
        modules = [p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")]
        modules += [p.parent.name for p in folder.glob("*/__init__.py")]
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if unnamed := _unnamed(doc, modules):
            missing[str(init.relative_to(REPO))] = unnamed
    for mod_rs in sorted(RUST.rglob("mod.rs")):
        if "target" in mod_rs.relative_to(RUST).parts:
            continue
        text = mod_rs.read_text()
        here = mod_rs.parent
        declared = [m for m in _RUST_MOD.findall(text) if (here / f"{m}.rs").is_file() or (here / m).is_dir()]
        doc = "\n".join(line for line in text.splitlines() if line.startswith("//!"))
        if unnamed := _unnamed(doc, declared):
            missing[str(mod_rs.relative_to(REPO))] = unnamed
    assert missing == {}, f"these folder docs do not name these modules of their folder: {missing}"
