"""The method kit: declarations the engine reads, a registry found without a list and without
model code, one round implementation on every path, and a module graph without cycles."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from securevfl.methods import ActiveMethod, PartyMethod, method_names, method_spec
from securevfl.methods.options import describe

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("crypto", "transport", "securevfl")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=120,
    )


def test_config_and_registry_load_no_model_code(tmp_path):
    """Parsing a config, finding every method and validating its options import neither torch
    nor the other heavy libraries (`securevfl keys --config` stays fast)."""
    config = tmp_path / "c.toml"
    config.write_text(
        '[run]\nmethod = "laser"\n[data]\npath = "x.csv"\n[method]\nbalanced = true\n'
        '[parties.a]\ncolumns = ["X1"]\n[parties.b]\ncolumns = ["X2"]\n'
    )
    done = _python(
        f"""
        import sys
        from securevfl.config import load_config
        from securevfl.methods import method_names, method_spec
        cfg = load_config({str(config)!r})
        assert cfg.options.balanced is True
        for name in method_names():
            method_spec(name).parse_options({{}})
        heavy = sorted(m for m in ("torch", "sklearn", "opacus", "tenseal", "scipy")
                       if m in sys.modules)
        print(heavy)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_config_loads_only_its_own_methods_module(tmp_path):
    """A role parses its config at start-up: only the configured method's module is imported
    (`a-b` looked for in `a_b`, then `a`, `b`), not every method's; a name found in no such
    module or unknown loads the whole registry, and an unknown name is still refused naming
    every method."""
    body = '[data]\npath = "x.csv"\n[parties.a]\ncolumns = ["X1"]\n[parties.b]\ncolumns = ["X2"]\n'
    paths = {}
    for method in ("splitnn", "tabvfl-le", "no-such-method", "x" * 300, "SplitNN"):
        paths[method] = tmp_path / f"config-{len(paths)}.toml"
        paths[method].write_text(f'[run]\nmethod = "{method}"\n' + body)
    done = _python(
        f"""
        import sys
        from securevfl.config import ConfigError, load_config
        from securevfl.methods.base import registry
        paths = { ({k: str(v) for k, v in paths.items()})!r}
        load_config(paths["splitnn"])
        print(sorted(registry()))
        others = ("laser", "vfem", "tabvfl", "ols", "local", "false_vfl", "ridge", "plugvfl",
              "vanilla_vfl", "standard_vfl", "combinatorial")
        print([m for m in others if "securevfl.methods." + m in sys.modules])
        load_config(paths["tabvfl-le"])
        print(sorted(registry()))
        for bad in ("no-such-method", "x" * 300, "SplitNN"):
            try:
                load_config(paths[bad])
            except ConfigError as exc:
                print("refused", "vanilla-vfl" in str(exc), "ensemble" in str(exc))
        """
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "['splitnn']"
    assert lines[1] == "[]"  # no other method's module was imported
    assert lines[2] == "['splitnn', 'tabvfl', 'tabvfl-le']"
    assert lines[3:] == ["refused True True"] * 3  # too long, wrong case: refused, no traceback


def test_a_plugin_declaring_a_built_in_name_is_refused_when_that_method_is_looked_up(tmp_path):
    """A config naming a built-in method loads only that module, and still the entry points:
    a plugin that declares the same name is refused (registered twice), never silently
    ignored or preferred."""
    (tmp_path / "shadow_method.py").write_text(
        "from securevfl.methods import MethodSpec\n"
        "SPEC = MethodSpec(name='ridge', active='securevfl.methods.ridge:RidgeActive',\n"
        "                  party='securevfl.methods.ridge:RidgeParty', tasks=('regression',))\n"
    )
    dist = tmp_path / "shadow_method-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shadow-method\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[securevfl.methods]\nridge = shadow_method:SPEC\n")
    done = _python(
        """
        from securevfl.methods import method_spec
        method_spec("ridge")
        """,
        PYTHONPATH=f"{tmp_path}:{REPO}",
    )
    assert done.returncode != 0
    assert "method 'ridge' is registered twice" in done.stderr


def test_keys_command_loads_no_model_code(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        '[run]\nmethod = "vfem"\n[data]\npath = "x.csv"\ntask = "regression"\n'
        '[parties.a]\ncolumns = ["X1"]\n[parties.b]\ncolumns = ["X2"]\n'
        '[policy]\nclear_releases = ["design.spectrum", "finish.*"]\n'
    )
    done = _python(
        f"""
        import sys
        from securevfl.cli import main
        assert main(["keys", "--config", {str(config)!r}, "--out", {str(tmp_path / "k")!r}]) == 0
        print("torch" in sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("False")


@pytest.mark.parametrize("name", method_names())
def test_every_method_declares_what_the_engine_reads(name):
    spec = method_spec(name)
    assert issubclass(spec.active_class(), ActiveMethod)
    assert issubclass(spec.party_class(), PartyMethod)
    ops = [op.name for op in spec.operations]
    assert ops and len(set(ops)) == len(ops), ops
    for op in spec.operations:
        assert op.doc, f"{name}: operation {op.name!r} has no doc"
        for release in op.releases:
            assert release.to in ("sum", "clear")
            if release.to == "clear":
                assert release.why, f"{name}: clear release {op.name}.{release.tensor} says not why"
    assert dataclasses.is_dataclass(spec.options)
    for entry in describe(spec.options):
        assert entry["doc"], f"{name}: option {entry['name']!r} is undocumented"
    spec.parse_options({})  # every default is valid


def test_a_method_from_another_distribution_is_found_through_its_entry_point(tmp_path):
    (tmp_path / "outside_method.py").write_text(
        textwrap.dedent(
            """
            from securevfl.methods import MethodSpec
            SPEC = MethodSpec(
                name="outside-ridge",
                active="securevfl.methods.ridge:RidgeActive",
                party="securevfl.methods.ridge:RidgeParty",
                tasks=("regression",),
            )
            """
        )
    )
    dist = tmp_path / "outside_method-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-method\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[securevfl.methods]\nridge2 = outside_method:SPEC\n")
    done = _python(
        """
        from securevfl.methods import method_names, method_spec
        print("outside-ridge" in method_names(), method_spec("outside-ridge").tasks)
        """,
        PYTHONPATH=f"{tmp_path}:{REPO}",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True ('regression',)"


# --------------------------------------------------------------------------------------------
# the module graph


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, module: str) -> set[str]:
    """Modules imported when `module` is imported (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes = [node] if isinstance(node, ast.Import | ast.ImportFrom) else []
        if isinstance(node, ast.Try):
            nodes = [n for n in node.body if isinstance(n, ast.Import | ast.ImportFrom)]
        for n in nodes:
            if isinstance(n, ast.Import):
                found.update(a.name for a in n.names)
            else:
                base = n.module or ""
                if n.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - n.level + 1])
                    base = f"{base}.{n.module}" if n.module else base
                found.add(base)
                found.update(f"{base}.{a.name}" for a in n.names)
    return found


def module_graph() -> dict[str, set[str]]:
    files = {
        _module_name(p): p
        for pkg in PACKAGES
        for p in (REPO / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in _top_level_imports(path, name) if m in files and m != name}
    return graph


def test_no_import_cycles_between_modules():
    graph = module_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_crypto_and_transport_never_import_ml_or_securevfl():
    for name, imports in module_graph().items():
        if name.split(".")[0] in ("crypto", "transport"):
            other = "transport" if name.startswith("crypto") else "crypto"
            bad = {m for m in imports if m.split(".")[0] in ("securevfl", other)}
            assert not bad, f"{name} imports {sorted(bad)}"
    for pkg in ("crypto", "transport"):
        for path in (REPO / pkg).rglob("*.py"):
            text = path.read_text()
            assert "import torch" not in text and "from torch" not in text, path


def test_method_modules_do_not_load_torch_at_import():
    """Every module that declares a method imports without torch (model code is imported
    inside functions), so discovery stays cheap."""
    done = _python(
        """
        import importlib, sys
        from securevfl.methods import method_names, method_spec
        for name in method_names():
            spec = method_spec(name)
            for ref in (spec.active, spec.party):
                if isinstance(ref, str):
                    importlib.import_module(ref.partition(":")[0])
        print("torch" in sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


# --------------------------------------------------------------------------------------------
# one round implementation


def _ledger(path: Path) -> list[tuple]:
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        out.append(
            (
                e["kind"],
                e["role"],
                e.get("mechanism"),
                e.get("noise_multiplier"),
                e.get("steps"),
                e.get("epoch"),
                e.get("what"),
            )
        )
    return sorted(out, key=repr)


def test_direct_path_writes_the_ledger_the_roles_write(tmp_path):
    """DP, the ledger and budgets are the roles' own on the direct path: the same config and
    seed give the same ledger events in memory as over the in-process transport."""
    from securevfl.config import DPConfig
    from securevfl.direct import DirectFederation
    from securevfl.inproc import run_federation
    from tests.securevfl.test_laser import INPROC_NETWORK, block_config

    def config(d):
        cfg = block_config(
            d,
            aggregation="mask",
            p_train=0.2,
            epochs=2,
            n=240,
            run={"transport": "inproc"},
            privacy={"label_dp": {"noise_multiplier": 2.0, "clip": 1.0}, "delta": 1e-5},
            network=INPROC_NETWORK,
        )
        dp = DPConfig(clip=1.0, noise_multiplier=1.0)
        parties = tuple(
            dataclasses.replace(p, embedding_dp=dp) if p.name == "p0" else p for p in cfg.parties
        )
        return dataclasses.replace(cfg, parties=parties)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fed = DirectFederation(config(tmp_path / "a"), run_dir=tmp_path / "a" / "run")
    fed.run()
    code, _ = run_federation(config(tmp_path / "b"), out=tmp_path / "b" / "run")
    assert code == 0
    direct = _ledger(tmp_path / "a" / "run" / "ledger.jsonl")
    roles = _ledger(tmp_path / "b" / "run" / "ledger.jsonl")
    assert direct == roles
    mechanisms = {e[2] for e in direct}
    assert {"label_dp", "embedding_dp"} <= mechanisms


def test_the_readme_layout_names_every_module():
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    layout = layout[: layout.index("Dependencies point one way")]
    missing = []
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], capture_output=True, text=True, cwd=REPO
    ).stdout.split()
    for pkg in PACKAGES:
        paths = sorted((REPO / pkg).rglob("*.py"))
        if tracked:  # a working tree may hold files not yet added
            paths = [p for p in paths if p.relative_to(REPO).as_posix() in tracked]
        for path in paths:
            rel = path.relative_to(REPO / pkg).as_posix()
            if path.name == "__init__.py" and rel != "methods/vfem/__init__.py":
                if rel not in ("methods/__init__.py",):
                    continue
            if rel.startswith("examples/") or "__pycache__" in rel:
                continue
            if rel not in layout and path.name not in layout:
                missing.append(f"{pkg}/{rel}")
    assert not missing, f"README Layout misses {missing}"
