"""ORPO's loss as TRL 1.16 computes it (``trl/experimental/orpo/orpo_trainer.py``): the model's own
(tokens, vocab) logits, not TRL's fused head (estimator/objectives.py has DPO's, KTO's and GRPO's).

``ORPOTrainer.concatenated_forward`` runs chosen and rejected rows (2 x batch) in one forward,
``outputs.logits`` in the compute dtype (transformers 5 does not upcast them without labels), then

- ``cross_entropy_loss`` on the chosen rows: ``logits[..., :-1, :].contiguous()`` (a copy, b (s-1) V)
  and ``nn.CrossEntropyLoss``: its ``log_softmax`` output (b (s-1) V, compute dtype) is saved;
- ``get_batch_logps`` over all 2b rows: ``trl/trainer/utils.py`` ``selective_log_softmax`` on
  ``logits[:, :-1, :]``. Off CUDA (or without Triton) in 16 bits it loops over the rows, each
  ``log_softmax`` output saved for its ``gather`` (2b (s-1) V in all); in fp32 it gathers and takes a
  per-row ``logsumexp``, which saves its input: the logits stay alive. With Triton on CUDA
  (``_supports_trl_loss_kernel``) ``trl/kernels/logprob_entropy.py`` ``_LogProbEntropyFunction``
  saves the logits (and fp32 row statistics) and writes one (2b, s-1, V) gradient in backward;
- ``odds_ratio_loss`` on the (2b,) averages, in fp32 (negligible).

``per_device_train_batch_size`` is pairs (2 x batch rows); ``max_length`` is a row's prompt +
completion (ORPOConfig has no ``max_prompt_length``; the answer is truncated); no reference model.
The backward's multiples of c N V are read off the traced step (truths/objective_trace.py, torch fold)
and the CUDA path's from the kernel's allocations; see docs/objectives.md.
"""

from __future__ import annotations

from ..specs import ModelSpec, Setup
from .activations import global_bytes_per_token
from .precision import compute_bytes
from .stack import DEFAULT_STACK, Stack

#: the TRL version these terms are read off
TRL_VERSION = "1.16"
#: transient (tokens x vocab) tensors beyond the saved ones in ORPO's backward, in units of the
#: rows' logits (2b s V, compute dtype), by path: read off the traced step (torch fold, 16-bit and
#: fp32) and, for Triton, the kernel's ``grad_logits`` plus the slice and row-split gradients
ORPO_BACKWARD_LOGITS = {"torch16": 1.5, "torch32": 3.0, "triton": 3.0}


def orpo_rows(setup: Setup) -> tuple[int, int]:
    """(rows, row length) of ORPO's forward: 2 x batch rows of ``seq`` tokens (prompt + completion),
    at most ``max_prompt_length + max_completion_length`` when both are given."""
    P, C = setup.max_prompt_length, setup.max_completion_length
    return 2 * setup.batch, min(setup.seq, P + C) if P and C else setup.seq


def orpo_loss_transients(model: ModelSpec, pol: Setup, rows: int, row_len: int,
                         stack: Stack = DEFAULT_STACK) -> tuple[int, int, int]:
    """(forward, backward, saved) of ORPO's loss over ``rows`` x ``row_len`` tokens (``pol``: the
    policy Setup of those rows). ``saved``: what stays from the forward to the backward outside the
    decoder layers (SFT's embeddings/norm terms without its fp32 log-probs, int64 labels of the
    NLL, and the log-softmax outputs or logits of the path); ``forward``: the logits alive at the
    loss beyond that; ``backward``: the logits' gradients at the head."""
    c, V = compute_bytes(pol), model.vocab_size
    N = rows * row_len
    chosen = rows // 2 * (row_len - 1)  # the chosen rows' shifted positions (the NLL's)
    shifted = rows * (row_len - 1)
    base = global_bytes_per_token(model, pol.replace(loss="hf", liger=False)) - 4 * V  # SFT's, less its log-probs
    saved = int(base * N) + 8 * N
    if stack.trl_triton:
        path = "triton"
        saved += c * V * (N + chosen)  # the kernel's saved logits; the NLL's log_softmax output
        forward = c * V * chosen  # the NLL's contiguous copy while its log_softmax runs
    elif c < 4:
        path = "torch16"
        saved += c * V * (chosen + shifted)  # log_softmax outputs: the NLL's and each row's
        forward = c * V * N  # the logits, alive until the loss returns
    else:
        path = "torch32"
        saved += c * V * (N + chosen)  # logsumexp keeps the logits; the NLL's log_softmax output
        forward = c * V * chosen
    backward = int(ORPO_BACKWARD_LOGITS[path] * c * V * N)
    return int(forward), backward, int(saved)


def orpo_notes(setup: Setup, rows: int, row_len: int) -> list[str]:
    """What the ORPO estimate counts, as a note."""
    return [f"objective orpo: TRL {TRL_VERSION} (trl.experimental.orpo ORPOTrainer), {rows} rows (chosen, rejected) "
            f"x {row_len} tokens per micro-batch, no reference; the model's (tokens, vocab) logits in "
            f"{setup.precision} with the chosen rows' NLL and selective_log_softmax (not TRL's fused head)"]
