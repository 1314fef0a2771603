"""Engine-side mechanisms the patches share: exact-size pinned host memory and views of it from
the GPU (:mod:`.host_pool`), a module list streamed through device slots (:mod:`.block_stream`),
and the offloaded QSA layers' host rows and staging arena (:mod:`.qsa_offload`).

They hold no patch's decisions (switches, which layer, which checkpoint): the adapters in
:mod:`flashnext.serving.hooks` make those and call in here, so that two patches needing pinned
memory share one pool and one path to the CUDA runtime rather than one hook importing another.
"""
