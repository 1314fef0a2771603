"""Stand-ins for the CUDA runtime's streams and events, for scenarios that drive vLLM's GPU model
runner on a machine without CUDA: vLLM's code records, waits on and enters streams and events
that cannot exist here. Installed before the scenario imports vLLM's runner."""

import torch


class NoCuda:  # a CUDA stream or event: the CUDA runtime is what this machine lacks
    def __init__(self, *args, **kwargs): pass
    def synchronize(self): pass
    def record(self, *args, **kwargs): pass
    def wait_stream(self, stream): pass
    def wait_event(self, event): pass
    def __enter__(self): return self
    def __exit__(self, *exc): return False


def install() -> None:
    torch.cuda.Stream = torch.cuda.Event = NoCuda
    torch.cuda.current_stream = lambda device=None: NoCuda()
    torch.cuda.stream = lambda stream: NoCuda()
    torch.cuda.set_stream = lambda stream: None
    torch.accelerator.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda tensor, stream: None  # a device-to-host copy is synchronous here
