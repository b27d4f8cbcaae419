"""Helpers shared by the op tests: random inputs, float64 references,
per-dtype tolerances, error bounds of reductions, and poisoned output memory."""

from __future__ import annotations

import contextlib
import io

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# (atol, rtol) for results computed in opmath and rounded once: rtol covers
# the result's own rounding (float16 1e-3 and bfloat16 1e-2: about one ulp)
# and a few ulps of elementwise error (float32 1e-5: 84 ulps); NaN never passes
# unless the reference has NaN in the same place and the test says so.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def rand(shape, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    """Fresh standard-normal values (never zeros), from the test's seed (conftest.py)."""
    return (torch.randn(shape, dtype=torch.float64, device=device) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype=None, equal_nan=False, scale=1.0, rtol_scale=1.0):
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    rtol *= rtol_scale
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol, equal_nan=equal_nan)


def unit_roundoff(dtype) -> float:
    """u of the arithmetic a dtype is computed in: float64's, or float32's (half types compute in float32)."""
    return 2.0**-53 if dtype == torch.float64 else 2.0**-24


def sum_error(terms: torch.Tensor, dim: int, dtype) -> torch.Tensor:
    """Allowed error of a sum of float64 `terms` along `dim` computed in `dtype`'s arithmetic.

    Each addition rounds by at most u times its partial sum; added one after another with
    independent errors, the error's standard deviation is u * ||cumsum(terms)||_2 / sqrt(3)
    (u * K * rms / sqrt(6) for random signs, u * sum * sqrt(K) / 3 for positive terms); kernels
    that keep several partial sums do better. Allowed: 3 u ||cumsum||_2, over 5 of those deviations,
    plus the terms at most u times their partial sum, which such a sum drops whole (a bias, not
    random: after one dominant exp, thousands of tiny ones).
    """
    u = unit_roundoff(dtype)
    partial = torch.cumsum(terms, dim)
    lost = torch.where(terms.abs() <= u * partial.abs(), terms.abs(), torch.zeros_like(terms)).sum(dim, keepdim=True)
    return 3 * u * partial.norm(dim=dim, keepdim=True) + lost


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, equal_nan=False):
    """|actual - expected| <= tol element by element, tol a float64 bound broadcast to expected's shape.

    Infinities must match exactly; NaN passes only where expected is NaN and equal_nan is set.
    """
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    tol = torch.as_tensor(tol, dtype=torch.float64).cpu().expand(e.shape)
    nan_a, nan_e = a.isnan(), e.isnan()
    same = (a == e) | (nan_a & nan_e & equal_nan)  # equal infinities, and NaN where allowed
    err = (a - e).abs()
    bad = ~same & ~(err <= tol)  # NaN err (one side NaN, or inf - inf) is never <= tol
    if bad.any():
        n = int(bad.sum())
        excess = torch.where(bad, (err / tol).nan_to_num(float("inf")), torch.zeros_like(err))
        i = tuple(int(k) for k in torch.nonzero(excess == excess.max())[0]) if e.dim() else ()
        raise AssertionError(
            f"{n} / {e.numel()} elements outside the bound; worst at index {i}: actual {a[i].item()!r}, "
            f"expected {e[i].item()!r}, error {err[i].item():.3g} > allowed {tol[i].item():.3g}"
        )


@contextlib.contextmanager
def poisoned(device="cpu"):
    """Uninitialised memory handed to kernels is NaN inside this block.

    torch's deterministic mode fills every fresh `empty` with NaN, on the CPU
    and the GPU, so an output element a kernel forgot to write shows up as
    NaN and fails the comparison. On CUDA the caching allocator's free blocks
    are also filled first, for allocations that skip that path.
    """
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        junk = torch.full((64 << 20,), float("nan"), device=device)
        del junk
    old = torch.are_deterministic_algorithms_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
        torch.utils.deterministic.fill_uninitialized_memory = old_fill


@contextlib.contextmanager
def cudnn_flags(**changes):
    """cuDNN's flags (``allow_tf32``, ``deterministic``, ``benchmark``) changed inside the block and
    put back after, through ``torch.backends.cudnn.flags``: setting them directly raises once any
    test has imported torch.testing._internal.common_utils, which disables the global flags."""
    cudnn = torch.backends.cudnn
    now = dict(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic)
    now["allow_tf32"] = cudnn.allow_tf32
    with cudnn.flags(**{**now, **changes}):
        yield


def saved_and_loaded(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` through ``torch.save`` and ``torch.load`` (a whole module: not weights only)."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def randomize_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    """Random BatchNorm statistics and affine parameters, in place: a fresh model's mean 0 /
    variance 1 would hide folding bugs."""
    for m in model.modules():
        # torchvision's FrozenBatchNorm2d holds the same four tensors, as buffers
        if isinstance(m, torch.nn.BatchNorm2d) or type(m).__name__ == "FrozenBatchNorm2d":
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model
