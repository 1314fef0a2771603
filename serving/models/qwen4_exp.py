"""vLLM's ``qwen4_exp`` model with its model state serving the PLE table file (patches ple-mmap,
decode-06 and ttft-01), registered under vLLM's own architecture names.

Model Runner V2 asks the model for its state class (``resolve_model_state_cls``:
``model.get_model_state_cls()``), so a subclass of vLLM's model returning a subclass of vLLM's state
changes the runner's per-step input preparation and request bookkeeping without a diff:

- ``__init__``: the rank's file-backed PLE layers (:func:`flashnext.serving.hooks.ple_file.attach`;
  none when ple-mmap is off or the layers live on another pipeline rank);
- ``add_request`` / ``remove_request``: the request's prefill tokens kept for hashing its rows on
  the host, and its prompt's pages read ahead from its first uncomputed token (ttft-01);
- ``prepare_inputs``: the step's row ids, its small steps' pages advised (decode-06), and its rows
  staged into the device buffer the forward reads (ple-mmap).

The classes are made on first access (a module ``__getattr__``, which is what vLLM's lazy
``"module:Class"`` registration imports), each a subclass of the class vLLM's own
``vllm.models.qwen4_exp`` picks for the platform, so flashnext's plugin imports no model at load.
vLLM caches what it inspects of a lazily registered class under this file's hash
(``$VLLM_CACHE_ROOT/modelinfos``); the series is pinned to one vLLM release, so a vLLM upgrade is a
port of the series, which re-checks it (``flashnext patches check``).
"""

from __future__ import annotations

from functools import cache

# vLLM's architecture names for this model; flashnext's classes take them over in its registry.
ARCHITECTURES = ("Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM")


def register() -> None:
    """Patches decode-06 and ttft-01's plugin registration (and ple-mmap's model state): both
    architectures resolve to this module's classes (idempotent: vLLM may load plugins again)."""
    from vllm.model_executor.models import ModelRegistry

    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"{__name__}:{architecture}")


def registered() -> bool:
    """Whether vLLM's registry in this process resolves both architectures to this module."""
    from vllm.model_executor.models import ModelRegistry

    return all(getattr(ModelRegistry.models.get(a), "module_name", None) == __name__ for a in ARCHITECTURES)


@cache
def model_state_class(base: type) -> type:
    """vLLM's ``Qwen4ExpModelState`` (``base``, the platform's) driving the PLE table file."""
    from flashnext.serving.hooks import ple_file

    class FlashnextQwen4ExpModelState(base):
        def __init__(self, vllm_config, model, encoder_cache, device) -> None:
            super().__init__(vllm_config, model, encoder_cache, device)
            self.ple_file = ple_file.attach(model)

        def add_request(self, req_index: int, new_req_data) -> None:
            super().add_request(req_index, new_req_data)
            if self.ple_file is not None:
                self.ple_file.add_request(new_req_data.req_id, new_req_data.prefill_token_ids,
                                          new_req_data.num_computed_tokens)

        def remove_request(self, req_id: str) -> None:
            super().remove_request(req_id)
            if self.ple_file is not None:
                self.ple_file.remove_request(req_id)

        def prepare_inputs(self, input_batch, req_states) -> dict:
            model_inputs = super().prepare_inputs(input_batch, req_states)
            if self.ple_file is not None:  # the rows are gathered on the host, outside CUDA graphs
                step_ids = self.ple_file.step_ids(input_batch, model_inputs["query_start_loc"],
                                                  model_inputs["ngram_context"])
                self.ple_file.advise(step_ids)
                self.ple_file.stage(step_ids)
            return model_inputs

    FlashnextQwen4ExpModelState.__qualname__ = FlashnextQwen4ExpModelState.__name__
    FlashnextQwen4ExpModelState.__module__ = __name__
    return FlashnextQwen4ExpModelState


@cache
def model_class(architecture: str) -> type:
    """vLLM's model class for ``architecture`` (as ``vllm.models.qwen4_exp`` picks it for the
    platform), handing the runner :func:`model_state_class` of its own state class."""
    import vllm.models.qwen4_exp as vllm_qwen4_exp

    base = getattr(vllm_qwen4_exp, architecture)
    state = model_state_class(base.get_model_state_cls())

    class Model(base):
        @staticmethod
        def get_model_state_cls():
            return state

    Model.__name__ = Model.__qualname__ = architecture
    Model.__module__ = __name__
    Model.__doc__ = f"vLLM's {architecture}; its model state is {state.__name__}."
    return Model


def __getattr__(name: str):
    if name in ARCHITECTURES:
        return model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
