"""flashnext/envs.py is the one home of the environment variables flashnext reads: declaring one
registers it, ``ALL`` is what the patched vLLM reads, and no module reads a variable it did not
declare there."""

import ast

import pytest

from support import ROOT

from flashnext import envs


def test_every_variable_of_the_module_and_every_patch_switch_is_declared_once():
    from flashnext.serving.patches.series import SERIES

    instances = [v for v in vars(envs).values() if isinstance(v, envs.EnvVar)] + [p.switch for p in SERIES]
    assert sorted(instances, key=lambda v: v.name) == sorted(envs.DECLARED, key=lambda v: v.name)
    assert len({v.name for v in envs.DECLARED}) == len(envs.DECLARED)
    with pytest.raises(ValueError, match="declared twice"):
        envs.EnvVar(envs.VLLM_PP_DEFER_RECV.name, "1", "again")
    assert len(envs.DECLARED) == len(instances)
    with pytest.raises(AttributeError, match="no attribute 'VLLM_NO_SUCH_SWITCH'"):
        envs.VLLM_NO_SUCH_SWITCH


def test_all_is_what_the_patched_vllm_reads_and_nothing_of_flashnexts_or_others():
    assert envs.ALL == tuple(v for v in envs.DECLARED if v.kind == envs.SERVING)
    assert envs.VLLM_HOST_POOL_LOCK in envs.ALL and envs.VLLM_QSA_ROW_CACHE in envs.ALL
    for other in (envs.FLASHNEXT_DEBUG, envs.TRITON_INTERPRET, envs.XDG_CACHE_HOME, envs.CUDA_VISIBLE_DEVICES):
        assert other not in envs.ALL
    assert all(v.name.startswith("VLLM_") for v in envs.ALL)
    assert not set(envs.THIRD_PARTY) & {v.name for v in envs.DECLARED}


def read_names(tree: ast.AST) -> set[str]:
    """The literal names read through ``os.environ.get``/``[...]``/``os.getenv``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and isinstance(node.args[0], ast.Constant) and (
                    (node.func.attr == "get" and ast.unparse(node.func.value) == "os.environ")
                    or ast.unparse(node.func) == "os.getenv"):
            names.add(node.args[0].value)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and ast.unparse(node.value) == "os.environ" and isinstance(node.slice, ast.Constant):
            names.add(node.slice.value)
    return names


def test_the_reader_finds_each_form():
    tree = ast.parse("import os\na = os.environ.get('A')\nb = os.environ['B']\nc = os.getenv('C', '')\nos.environ['D'] = '1'")
    assert read_names(tree) == {"A", "B", "C"}


def test_every_variable_flashnext_reads_is_declared():
    declared = {v.name for v in envs.DECLARED}
    undeclared = {}
    for folder in ("flashnext", "quant", "serving", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            if missing := read_names(ast.parse(path.read_text())) - declared:
                undeclared[str(path.relative_to(ROOT))] = sorted(missing)
    assert undeclared == {}
