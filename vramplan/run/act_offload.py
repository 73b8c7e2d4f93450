"""Activation offloading as TRL 1.16 runs it, inside the fake-tensor tracer (``--activation-offload``).

TRL's ``SFTTrainer.training_step`` runs ``Trainer.training_step`` (forward and backward) under
``get_act_offloading_ctx_manager(model)`` (trl/models/activation_offloading.py, TRL 1.16; torchtune
0.6.1's ``training/_activation_offloading.py`` is the same code's origin): an
``OffloadActivations`` ``saved_tensors_hooks`` with ``use_streams=True``, ``use_pin_memory=True``,
``min_offload_size=1024``, ``max_fwd_stash_size=5``, with the output head (``lm_head``) under a
``NoOpManager`` (its saved tensors stay on the device). What this module runs is that real code:
``get_act_offloading_ctx_manager`` builds the manager, its own ``pack_tensor`` /
``unpack_tensor_with_streams`` decide what moves, what is deduplicated, what the forward stash keeps
alive and when the backward frees it. The stand-ins, each at the narrowest point:

- **the device**: the tracer's fake tensors live on ``cpu``; ``torch.accelerator.current_accelerator``
  answers ``cpu`` while the manager is built, so ``cpu`` plays the accelerator. The host copies the
  manager makes (``torch.empty_like(..., device="cpu")`` + ``copy_``) are told apart by the counter:
  every storage in the manager's ``tracker`` marked as offloaded counts as host RAM, and the tensor
  ``unpack`` returns counts as device memory again (on CUDA, ``.to("cuda")`` allocates a device copy
  of the same bytes and the host copy dies with its tracker entry; here ``.to("cpu")`` returns the
  host tensor itself, re-labelled device: the same bytes at the same moments);
- **the streams**: ``device_module`` is a no-op stream module (torch.cpu's ``Stream`` plus the
  ``synchronize`` the manager's ``__exit__`` calls): events and waits order copies on a GPU, they
  hold no tensor; every reference the manager keeps (``fwd_stash``, ``bwd_tensor_stash``) is real;
- **pinned memory**: ``use_pin_memory=False`` (pinning needs CUDA; it changes where host pages
  live, not how many bytes);
- **storage pointers**: a fake storage's ``data_ptr()`` is 0, which would make every tensor a
  duplicate of every other in the manager's storage deduplication and hide the parameters from
  ``update_model_params``; while the manager runs, a fake ``UntypedStorage.data_ptr`` answers the
  storage object's id (unique while it lives, as a pointer is; real storages keep their pointer).
"""

from __future__ import annotations

import contextlib
import warnings

__all__ = ["HostStreams", "fake_storage_pointers", "host_record_stream", "offload_manager", "offload_step"]


class HostStreams:
    """The stream module the manager is given: torch.cpu's no-op streams with ``synchronize``.
    ``stream(s)`` is where the manager allocates and fills its host copies (in ``pack``): what is
    allocated there while packing is host RAM from its first byte (``counter.host_context``)."""

    class Stream:
        def __init__(self, priority: int = -1) -> None:
            pass

        def wait_stream(self, stream) -> None:
            pass

        def record_event(self) -> None:
            return None

        def wait_event(self, event) -> None:
            pass

        def synchronize(self) -> None:
            pass

    def __init__(self, counter) -> None:
        self.counter = counter
        self.packing = False
        self._current = self.Stream()

    def current_stream(self, device=None):
        return self._current

    @contextlib.contextmanager
    def stream(self, stream):
        self.counter.host_context = self.packing
        try:
            yield
        finally:
            self.counter.host_context = False

    def empty_cache(self) -> None:  # __enter__ calls it once bitsandbytes is imported
        pass


@contextlib.contextmanager
def fake_storage_pointers():
    import torch

    original = torch.UntypedStorage.data_ptr
    # a real storage keeps its pointer; a fake one (0) answers its Python object's id, which the
    # fake-tensor mode keeps for the storage's life (the live-tensor counter relies on it too)
    torch.UntypedStorage.data_ptr = lambda self: original(self) or id(self)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
            yield
    finally:
        torch.UntypedStorage.data_ptr = original


def offload_manager(model, counter, inner_pack):
    """TRL's activation-offloading manager for ``model``, built once as ``SFTTrainer.__init__``
    builds it, its host copies counted as host by ``counter`` (``mark_host`` / ``unmark_host``);
    ``inner_pack`` (the tracer's own saved-tensor hook) sees each saved tensor first. Enter
    :func:`offload_step` around each forward and backward."""
    import torch
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    with fake_storage_pointers():
        accel = torch.accelerator.current_accelerator
        torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
        try:
            ctx = get_act_offloading_ctx_manager(model, use_pin_memory=False, warn_if_no_head=False)
        finally:
            torch.accelerator.current_accelerator = accel
    streams = HostStreams(counter)
    ctx.device_module = streams
    if ctx.use_streams:
        ctx.s1 = streams.Stream()
    trl_pack, trl_unpack = ctx.pack_hook, ctx.unpack_hook

    def pack(t):
        t = inner_pack(t)
        streams.packing = True
        try:
            tensor_id = trl_pack(t)
        finally:
            streams.packing = False
        entry = ctx.tracker.get(tensor_id)
        if entry is not None and entry[1]:  # offloaded: its host copy is host RAM
            counter.mark_host(entry[0])
        return tensor_id

    def unpack(tensor_id):
        t = trl_unpack(tensor_id)
        counter.unmark_host(t)  # on the device again (CUDA: a device copy of the same bytes)
        return t

    ctx.pack_hook, ctx.unpack_hook = pack, unpack
    return ctx


@contextlib.contextmanager
def host_record_stream():
    """``Tensor.record_stream`` accepting the no-op streams: the manager calls it on an unpacked tensor whose
    storage a backward node's outputs or a checkpointed layer's recomputed saves still view (Liger's RMSNorm
    saves ``X.view(-1, h)`` of the layer input: "Note: [Track views of the unpacked]") and drops its own
    reference. On CUDA it only delays the block's reuse until the compute stream's queued work is done; it
    allocates nothing and keeps no reference, so here it is a no-op (the views keep the bytes alive)."""
    import torch

    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, HostStreams.Stream):
            return None
        return original(self, stream)

    torch.Tensor.record_stream = record_stream
    try:
        yield
    finally:
        torch.Tensor.record_stream = original


@contextlib.contextmanager
def offload_step(ctx):
    """One training step (forward and backward) under the manager, as ``SFTTrainer.training_step``."""
    with fake_storage_pointers(), host_record_stream(), ctx:
        yield ctx
