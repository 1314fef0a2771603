"""Calibration for ``make-mtp-int4 --calib``: which input columns of each expert matter, and how much.

The input is a safetensors file with one tensor, ``hidden_states`` ``[N, hidden]`` (or
``[B, T, hidden]``): activations at the input of the MTP layer's MoE block, what its router
(``mlp.gate``) and its experts multiply. ``docs/make-mtp-int4.md`` shows how to capture them from a
served model or from the BF16 head.

Routing-aware: the tokens are routed with the layer's own router (softmax, top-k, renormalized as
the config says), and each expert's statistics come from the tokens routed to it, each weighted by
its routing weight squared (the expert's output enters the block's output scaled by that weight):

* gate and up (input ``x``): ``d_in[j] = sum_t r_t^2 x_tj^2``, the diagonal of ``X^T R^2 X``;
* down (input ``a = silu(x W_gate^T) * (x W_up^T)``, from the BF16 weights): ``d_mid[j] = sum_t r_t^2 a_tj^2``.

An expert that sees fewer than ``min_tokens`` tokens is topped up with the average over a fixed
sample of all tokens run through that expert (``min_tokens - n`` of them, at the mean routing weight),
so a rarely routed expert is quantized for typical activations rather than for its few, and one that
no token reached is not quantized blind. A small damping (1% of the mean) keeps every column in
play.

One token in :data:`HOLD_OUT` is held out of the statistics (when there are at least
:data:`MIN_HOLD_OUT_TOKENS`): the overlay's report measures output error on those, so that a method
fitted to the calibration tokens (GPTQ, with a few hundred tokens an expert against a 2,560-wide
input) is not credited for fitting them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashnext.errors import FlashnextError
from flashnext.quant.records.inputs import open_regular

CALIB_TENSOR = "hidden_states"
FALLBACK_SAMPLE = 1024  # tokens of the all-token sample that tops up rarely routed experts
DAMPING = 0.01
HOLD_OUT = 8              # every 8th token is held out for the report's output error
MIN_HOLD_OUT_TOKENS = 64


@dataclass
class Calibration:
    hidden: torch.Tensor  # [N, H] float32
    path: Path

    @property
    def tokens(self) -> int:
        return self.hidden.shape[0]


def load_calibration(path: Path, hidden_size: int) -> Calibration:
    """Read and check the calibration file (one line of error, ``field="calib"``, for anything wrong with it)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        opened = open_regular(path, "a safetensors file of activations")
    except FileNotFoundError:
        raise FlashnextError(f"{path}: no such file", field="calib") from None
    except IsADirectoryError:
        raise FlashnextError(f"{path}: is a directory, not a safetensors file", field="calib") from None
    except FlashnextError as e:
        raise FlashnextError(str(e), field="calib") from None
    # safetensors opens by name: through /proc/self/fd it opens the very file just checked, so that
    # a swap of the name for a FIFO in between cannot block it.
    through = Path(f"/proc/self/fd/{opened.fileno()}")
    with opened:
        try:
            with safe_open(str(through if through.exists() else path), "pt") as f:
                if CALIB_TENSOR not in f.keys():
                    raise FlashnextError(f"{path}: no tensor {CALIB_TENSOR!r} "
                                         f"(has: {', '.join(sorted(f.keys()))[:200]})", field="calib")
                hidden = f.get_tensor(CALIB_TENSOR)
        except SafetensorError as e:
            raise FlashnextError(f"{path}: not a safetensors file ({e})", field="calib") from None
    if hidden.dim() == 3:
        hidden = hidden.reshape(-1, hidden.shape[-1])
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size or hidden.shape[0] == 0:
        raise FlashnextError(f"{path}: {CALIB_TENSOR} has shape {tuple(hidden.shape)}; "
                             f"expected [tokens, {hidden_size}] (the MTP MoE block's input)", field="calib")
    if not hidden.is_floating_point():
        raise FlashnextError(f"{path}: {CALIB_TENSOR} is {hidden.dtype}, not floating point", field="calib")
    hidden = hidden.to(torch.float32)
    if not torch.isfinite(hidden).all():
        raise FlashnextError(f"{path}: {CALIB_TENSOR} contains NaN or Inf", field="calib")
    return Calibration(hidden, path)


def route(hidden: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, k], weights [N, k])``: softmax over the router's logits, the top ``k``, and
    (``norm_topk_prob``) those renormalized to sum to 1, as the model routes."""
    probs = torch.softmax(hidden @ router.to(torch.float32).T, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@dataclass
class ExpertImportance:
    """One expert's calibration inputs, each row scaled by its routing weight (the top-up sample's
    rows included): ``x_in [rows, hidden]`` for gate/up, ``x_mid [rows, intermediate]`` for down.
    Their Gram matrices (``gram``) are what GPTQ rounds against, and ``d_in``/``d_mid``, those
    matrices' damped diagonals, what the scale search weights columns by."""

    x_in: torch.Tensor
    x_mid: torch.Tensor
    tokens: int
    topped_up: bool
    held_in: torch.Tensor | None = None   # the held-out tokens routed here, scaled alike
    held_mid: torch.Tensor | None = None
    prior_in: torch.Tensor | None = None  # GPTQ's prior Gram matrices (see RoutedStatistics)
    prior_mid: torch.Tensor | None = None

    def held_out(self, proj: str) -> torch.Tensor:
        return self.held_mid if proj == "down" else self.held_in

    @property
    def d_in(self) -> torch.Tensor:
        return _damped((self.x_in * self.x_in).sum(0))

    @property
    def d_mid(self) -> torch.Tensor:
        return _damped((self.x_mid * self.x_mid).sum(0))

    def inputs(self, proj: str) -> torch.Tensor:
        return self.x_mid if proj == "down" else self.x_in

    def gram(self, proj: str) -> torch.Tensor:
        x = self.inputs(proj)
        prior = self.prior_mid if proj == "down" else self.prior_in
        return x.T @ x if prior is None else x.T @ x + prior


def column_importance(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``diag(XᵀWX)`` of activations ``x [tokens, K]`` (``weights [tokens]`` per token, default 1),
    damped: what :func:`~flashnext.quant.quantizers.mse_rtn.quantize_mse_rtn` takes as ``importance``."""
    w = torch.ones(x.shape[0], 1, device=x.device) if weights is None else weights.reshape(-1, 1)
    return _damped((w * x * x).sum(0))


def gram_importance(gram: torch.Tensor) -> torch.Tensor:
    """:func:`column_importance` from a Gram matrix ``XᵀX [K, K]`` rather than the activations,
    for callers that accumulate ``XᵀX`` over more tokens than they can hold."""
    return _damped(gram.diagonal().to(torch.float32))


class RoutedStatistics:
    """Per-expert importance for one MTP layer, from its router and the calibration tokens."""

    def __init__(self, calib: Calibration, router: torch.Tensor, top_k: int, renormalize: bool,
                 min_tokens: int = 32, prior_tokens: int = 0):
        hidden = calib.hidden
        held = torch.zeros(hidden.shape[0], dtype=torch.bool)
        if hidden.shape[0] >= MIN_HOLD_OUT_TOKENS:
            held[HOLD_OUT - 1::HOLD_OUT] = True
        self.hidden, self.held = hidden[~held], hidden[held] if held.any() else hidden
        self.held_is_separate = bool(held.any())
        self.ids, self.weights = route(self.hidden, router, top_k, renormalize)
        self.held_ids, self.held_weights = route(self.held, router, top_k, renormalize)
        self.min_tokens = min_tokens
        # GPTQ fits an expert's codes to its Gram matrix; a few hundred routed tokens against a
        # 2,560-wide input leave it rank-deficient, and the codes then fit those tokens rather than
        # the expert's inputs. ``prior_tokens`` adds that many tokens' worth of the all-token Gram
        # matrix (for down: of a sample of all tokens run through the expert).
        self.prior_tokens = prior_tokens
        self._mean_gram_in: torch.Tensor | None = None
        self.mean_r2 = float((self.weights ** 2).mean())
        step = max(1, self.hidden.shape[0] // FALLBACK_SAMPLE)
        self.sample = self.hidden[::step][:FALLBACK_SAMPLE]
        counts = torch.bincount(self.ids.reshape(-1), minlength=router.shape[0])
        self.tokens_per_expert = counts.tolist()

    def expert(self, e: int, w_gate: torch.Tensor, w_up: torch.Tensor) -> ExpertImportance:
        """Importance for expert ``e`` with its BF16 (here float32) ``gate``/``up`` weights [I, H]."""
        rows, slot = (self.ids == e).nonzero(as_tuple=True)
        r = self.weights[rows, slot].unsqueeze(1)
        x = self.hidden[rows] * r  # r * x: its Gram matrix is Xᵀ R² X
        a = _activation(self.hidden[rows], w_gate, w_up) * r
        n = int(rows.numel())
        topped_up = n < self.min_tokens
        if topped_up:
            # The sample's rows, scaled so that they weigh (min_tokens - n) tokens at the mean r².
            k = ((self.min_tokens - n) * self.mean_r2 / self.sample.shape[0]) ** 0.5
            x = torch.cat([x, self.sample * k])
            a = torch.cat([a, _activation(self.sample, w_gate, w_up) * k])
        rows, slot = (self.held_ids == e).nonzero(as_tuple=True)
        r = self.held_weights[rows, slot].unsqueeze(1)
        held = self.held[rows]
        out = ExpertImportance(x, a, n, topped_up, held * r, _activation(held, w_gate, w_up) * r)
        if self.prior_tokens:
            if self._mean_gram_in is None:
                self._mean_gram_in = self.hidden.T @ self.hidden / self.hidden.shape[0]
            weight = self.prior_tokens * self.mean_r2
            sa = _activation(self.sample, w_gate, w_up)
            out.prior_in = weight * self._mean_gram_in
            out.prior_mid = weight * (sa.T @ sa) / sa.shape[0]
        return out

    def summary(self) -> dict:
        counts = sorted(self.tokens_per_expert)
        return {"tokens": int(self.hidden.shape[0] + (self.held.shape[0] if self.held_is_separate else 0)),
                "held_out_tokens": int(self.held.shape[0]) if self.held_is_separate else 0,
                "min_tokens": self.min_tokens,
                "tokens_per_expert": {"min": counts[0], "median": counts[len(counts) // 2], "max": counts[-1]},
                "experts_topped_up": sum(c < self.min_tokens for c in counts),
                "experts_without_tokens": sum(c == 0 for c in counts)}


def _activation(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)


def _damped(d: torch.Tensor) -> torch.Tensor:
    mean = d.mean()
    return d + DAMPING * mean if mean > 0 else torch.ones_like(d)
