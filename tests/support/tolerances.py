"""How far a value computed from loaded arrays may be from its reference.

What a load returns is compared bit for bit. What is *computed* from it (a matmul, a forward
pass, logits) is not: XLA and torch pick kernels, reduction orders, FMA and vector widths by
host CPU, device count and flags, so the same program on the same bits rounds differently on
another machine. A bare ``rtol`` fails there on any element that is small after cancellation
(its terms are large, their sum is not); a fixed ``atol`` is blind to scale (too tight for
large terms, too loose to catch a wrong layout when the terms are small). Each tolerance here
is an ``atol`` per element, on the scale of the terms that element sums.

The bound is the classic one for a sum of ``n`` products evaluated in any order, with or
without FMA (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5):

    |computed - exact| <= gamma_n * sum_i |x_i * y_i|,   gamma_n = n u / (1 - n u)

with ``u`` the unit roundoff (half the machine epsilon). It holds for any reduction tree, so a
different CPU, device count or ``--xla_cpu_enable_fast_math`` stays inside it, while a wrong
layout moves an element by about the size of its terms, ``1 / gamma_n`` times more.

A forward pass chains many contractions. To first order each level adds at most ``gamma_n`` of
the magnitude of its own terms, and the normalisations between levels (RMSNorm, softmax) carry
relative errors through unchanged, so the logits' error is bounded by the number of levels
times ``gamma_n`` times the magnitude of the terms of the last contraction (the head:
``|h| @ |W|``, read from the reference model itself). Comparing two float32 computations (JAX
against transformers) doubles it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# Contraction levels per decoder layer on the longest path: two RMSNorm means, q/k/v, scores,
# the softmax sum, probabilities @ v, o_proj, the router, gate/up and down. Rounded up.
LEVELS_PER_LAYER = 12


def gamma(n: int, dtype=np.float32) -> float:
    """Higham's gamma_n: the relative bound of a sum of ``n`` products in ``dtype``."""
    u = float(ml_dtypes.finfo(dtype).eps) / 2
    if n * u >= 1:
        raise ValueError(f"no bound for {n} terms in {np.dtype(dtype)}")
    return n * u / (1 - n * u)


def matmul_reference(x, w, b=None, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``x @ w (+ b)`` computed exactly enough (float64) and each element's atol in ``dtype``."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact, terms, n = x64 @ w64, np.abs(x64) @ np.abs(w64), x64.shape[-1]
    if b is not None:
        b64 = np.asarray(b, np.float64)
        exact, terms, n = exact + b64, terms + np.abs(b64), n + 1
    return exact, gamma(n, dtype) * terms


def forward_atol(head_input, head_weight, *, layers: int, contraction: int, computations: int = 2,
                 dtype=np.float32) -> np.ndarray:
    """Per-logit atol of a ``layers``-deep float forward pass whose longest sum has
    ``contraction`` terms; ``head_input`` (..., D) is what the output projection
    ``head_weight`` (V, D) multiplies."""
    levels = LEVELS_PER_LAYER * layers + 2  # + the final norm and the head
    return computations * levels * gamma(contraction, dtype) * _head_terms(head_input, head_weight)


def _head_terms(head_input, head_weight) -> np.ndarray:
    """``|head_input| @ |head_weight|.T``: the magnitude of each logit's terms."""
    return np.abs(np.asarray(head_input, np.float64)) @ np.abs(np.asarray(head_weight, np.float64)).T


def assert_within(actual, expected, atol, err_msg: str = "") -> None:
    """Every element of ``actual`` within its ``atol`` of ``expected``; the failure names the
    worst element (by its share of its tolerance), the difference and the tolerance."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    atol = np.broadcast_to(np.asarray(atol, np.float64), expected.shape)
    assert actual.shape == expected.shape, f"{err_msg}: shape {actual.shape} != {expected.shape}"
    diff = np.abs(actual - expected)
    ratio = np.where(atol > 0, diff / np.where(atol > 0, atol, 1), np.where(diff > 0, np.inf, 0))
    ratio = np.where(np.isnan(diff), np.inf, ratio)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape) if ratio.size else ()
    if ratio.size and ratio[worst] > 1:
        bad = int(np.count_nonzero(ratio > 1))
        raise AssertionError(
            f"{err_msg + ': ' if err_msg else ''}{bad} of {ratio.size} elements outside their tolerance; "
            f"worst at {tuple(int(i) for i in worst)}: {actual[worst]!r} vs {expected[worst]!r}, "
            f"difference {diff[worst]:.3g} > atol {atol[worst]:.3g} ({ratio[worst]:.3g}x)")


def _query_width(config) -> int:
    """Query heads times the widest head: a heterogeneous config (Gemma 4's global layers have
    wider heads) has no single ``head_dim`` (transformers refuses to read one)."""
    try:
        dims = [getattr(config, "head_dim", None)]
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        dims = [config.per_layer_config[i].head_dim for i in range(config.num_hidden_layers)]
    return config.num_attention_heads * max(d or config.hidden_size // config.num_attention_heads for d in dims)


def causal_lm_reference(model, tokens, *, head_dtype=None, **call) -> tuple[np.ndarray, np.ndarray]:
    """A transformers causal LM's logits on ``tokens`` and each logit's :func:`forward_atol`
    against another float32 implementation: the head's input is captured by a hook.

    ``head_dtype``: the dtype the other implementation rounds the head's weight to (MaxText's
    tied head, ``attend_on_embedding``, multiplies by the embedding cast to bfloat16): each
    term then moves by up to that dtype's unit roundoff, added to the atol."""
    import torch

    captured = []
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(inputs[0].detach()))
    try:
        with torch.no_grad():
            logits = model(torch.as_tensor(np.asarray(tokens, np.int64)), **call).logits.float().numpy()
    finally:
        handle.remove()
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    widths = [config.hidden_size, np.shape(tokens)[-1], _query_width(config)]
    widths += [getattr(config, name) for name in ("intermediate_size", "moe_intermediate_size", "num_local_experts",
                                                  "num_experts") if isinstance(getattr(config, name, None), int)]
    head_input, head_weight = captured[-1].float().numpy(), head.weight.detach().float().numpy()
    atol = forward_atol(head_input, head_weight, layers=config.num_hidden_layers, contraction=max(widths))
    if head_dtype is not None:
        atol = atol + gamma(1, head_dtype) * _head_terms(head_input, head_weight)
    return logits, atol
