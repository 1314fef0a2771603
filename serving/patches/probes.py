"""Each entry's probe: what proves, in a patched tree, that the patch is there.

A diff's probe is derived from the diff (:func:`lines_in_tree`), so a patch is not described twice;
a plugin entry's is a function here, as is each absorbed patch's probe of upstream's fix. They are
functions rather than text so that they are linted and imported like the rest of the code.
`flashnext patches check` and the selftest call them all in one fresh interpreter that imports the
patched tree (``patch_series.probe_tree``), so each imports vLLM inside its body: importing this
module must not import vLLM.
"""

import inspect
import os
import re
from pathlib import Path

_HUNK = re.compile(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def diff_files(diff: str) -> list[str]:
    """The files a unified diff changes, in its order (``+++ b/<path>``)."""
    return [line[len("+++ b/"):].split("\t")[0] for line in diff.splitlines() if line.startswith("+++ b/")]


def diff_hunks(diff: str) -> list[tuple[str, list[str], list[str]]]:
    """Each hunk of a unified diff as (file, the lines it adds, the lines it removes), read by the
    hunks' own line counts; the text before the first file header (a patch's prose) is skipped, as
    ``patch`` does."""
    lines, hunks, file, i = diff.splitlines(), [], None, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ b/"):
            file = line[len("+++ b/"):].split("\t")[0]
        elif file is not None and (m := _HUNK.match(line)):
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
            added, removed = [], []
            while old or new:
                i += 1
                tag, text = lines[i][:1], lines[i][1:]
                if tag in (" ", ""):
                    old, new = old - 1, new - 1
                elif tag == "-":
                    old -= 1
                    removed.append(text)
                elif tag == "+":
                    new -= 1
                    added.append(text)
            hunks.append((file, added, removed))
        i += 1
    return hunks


def lines_in_tree(patch_file: str, hunks: list[tuple[str, list[str]]]) -> None:
    """A diff's probe: the lines each of its hunks adds, but for those a later patch of the series
    removes (``patch_series`` passes them), stand in the tree's copy of the file in their order."""
    import vllm

    root = Path(os.path.abspath(vllm.__file__)).parent.parent
    for n, (rel, added) in enumerate(hunks, 1):
        lines = iter((root / rel).read_text(encoding="utf-8").splitlines())
        missing = next((line for line in added if line not in lines), None)  # `in` consumes: an ordered match
        assert missing is None, f"{rel}: hunk {n} of {patch_file} is not in the tree (its line {missing.strip()!r})"


def int6_bitplane() -> None:
    # vLLM's own plugin loading (as its engine and workers do) registers flashnext's config
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    config = get_quantization_config('compressed-tensors')
    assert config.__name__ == 'FlashnextCompressedTensorsConfig', f'compressed-tensors resolves to {config.__qualname__}'



def qwen4_exp_model_state() -> None:
    # vLLM's own plugin loading registers flashnext's model; the runner asks it for its state class
    from vllm.model_executor.models import ModelRegistry
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    for architecture in ('Qwen4ExpForConditionalGeneration', 'Qwen4ExpForCausalLM'):
        # what resolve_model_cls loads for an architecture, without the model config it normalizes with
        model_cls = ModelRegistry._try_load_model_cls(architecture)
        assert model_cls is not None and model_cls.__module__ == 'flashnext.serving.models.qwen4_exp', \
            f'{architecture} resolves to {model_cls}'
        state = model_cls.get_model_state_cls()
        assert state.__name__ == 'FlashnextQwen4ExpModelState', f'its model state is {state.__qualname__}'
        assert issubclass(state, model_cls.__mro__[1].get_model_state_cls())  # vLLM's own, extended


# What finds upstream's own fix of an absorbed patch (series.ABSORBED): passes on stock 0.34.0.

def upstream_mtp_03() -> None:
    import vllm.v1.worker.gpu.spec_decode.utils as u
    assert '_draft_tokens_by_req' in inspect.getsource(u.DraftTokensHandler.__init__)
    assert callable(getattr(u.DraftTokensHandler, 'begin_step', None))
    assert callable(getattr(u.DraftTokensHandler, 'discard', None))


def upstream_pp_ple() -> None:
    import vllm.model_executor.models.config as c
    assert 'requires pipeline_parallel_size=1' not in inspect.getsource(c.Qwen4ExpForConditionalGenerationConfig)
    import vllm.models.qwen4_exp.nvidia.model_state as m
    assert 'pipeline_parallel_size > 1' not in inspect.getsource(m.Qwen4ExpModelState.__init__)
    import vllm.v1.core.kv_cache_planning as p
    # each group's own layer names, not the whole-model spec's (0.33.0 iterated kv_cache_specs)
    src = inspect.getsource(p.get_kv_cache_config_from_groups)
    assert 'in group.layer_names' in src and 'group_spec.kv_cache_specs.items()' not in src


def upstream_mem_01() -> None:
    import vllm.models.qwen4_exp.nvidia.model as m
    assert 'PPMissingLayer()' in inspect.getsource(m.Qwen4ExpModel.__init__)
    assert 'PPMissingLayer()' in inspect.getsource(m.Qwen4ExpForCausalLM.__init__)


def upstream_mtp_01_branch() -> None:
    import vllm.models.qwen4_exp.nvidia.mtp as m
    src = inspect.getsource(m.Qwen4ExpMultiTokenPredictor.forward)
    assert 'get_pp_group().is_first_rank' not in src and 'if intermediate_tensors is None:' in src
