"""opforge.optimize on torchvision's classification models: outputs and one training step against float64.

Each model is built with random weights (``weights=None``), its BatchNorm
statistics and affine parameters randomized (a fresh model's mean 0 /
variance 1 hides folding bugs), then optimized with ``example_inputs`` as a
user would, once in eval mode and once in training mode, and checked:

- eval: the optimized model's outputs against the original's, and both
  against the original run in float64 (relative to the largest output);
  the original's own error is the larger of its NCHW and channels_last runs
  (optimize may run a model channels_last inside, where torch's kernels
  round differently);
- training: one forward + backward of ``sum of squares' means`` over every
  output (a training googlenet or inception also returns its aux heads),
  dropout and stochastic depth drawing the same masks (the same seed before
  each forward); the loss and every gradient against float64's, relative to
  the largest float64 gradient (the original's own error again the larger
  of its two layouts', per parameter).

A small batch in training mode leaves BatchNorm a few values per channel,
which amplifies rounding: the original's own float32 error is printed beside
the optimized model's, and a model is flagged ``WORSE`` where the optimized
one is more than twice as far from float64 as the original is (plus a floor:
1e-5 of the largest output, 1e-4 of the largest gradient). The exit status is
1 when any model failed or was flagged.

    python tools/model_zoo_check.py                        # every model up to 64M parameters
    python tools/model_zoo_check.py --models mobilenet_v2,googlenet --json zoo.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
import torchvision

import opforge

FLOOR = {"eval": 1e-5, "train": 1e-4}


def randomized(name: str, size_limit: float) -> torch.nn.Module | None:
    """The model with random BatchNorm state, or None when it has more than size_limit parameters."""
    extra = {"init_weights": True} if name in ("googlenet", "inception_v3") else {}
    model = torchvision.models.get_model(name, weights=None, **extra)
    if sum(p.numel() for p in model.parameters()) > size_limit:
        return None
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def outputs(y) -> list[torch.Tensor]:
    """A model's tensor outputs (a training googlenet returns a named tuple with aux heads, some None)."""
    return [y] if isinstance(y, torch.Tensor) else [t for t in y if isinstance(t, torch.Tensor)]


def rel(a: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest difference over all tensors, relative to the largest reference value."""
    return max(rel_each(a, ref))


def rel_each(a: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Each tensor's largest difference, relative to the largest reference value of them all."""
    scale = max(r.abs().max().item() for r in ref) or 1.0
    return [(x.double() - r.double()).abs().max().item() / scale for x, r in zip(a, ref, strict=True)]


def check_eval(model: torch.nn.Module, x: torch.Tensor) -> dict:
    model = model.eval()
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    with torch.no_grad():
        ref = outputs(model(x))
        ref_cl = outputs(_channels_last(model)(_channels_last(x)))
        got = outputs(fast(x))
        exact = outputs(copy.deepcopy(model).double()(x.double()))
    return {
        "replaced": len(report.replaced),
        "layers": len(report.layers),
        "vs_original": rel(got, ref),
        "original_vs_float64": max(rel(ref, exact), rel(ref_cl, exact)),
        "optimized_vs_float64": rel(got, exact),
    }


def _channels_last(m):
    """A channels_last copy of a model or input: optimize may run a model that way inside, and torch's
    own kernels round differently there (densenet121's training step: 3e-2 of the largest gradient
    from float64 channels_last, 1.4e-3 NCHW, on the CPU)."""
    if isinstance(m, torch.Tensor):
        return m.contiguous(memory_format=torch.channels_last)
    return copy.deepcopy(m).to(memory_format=torch.channels_last)


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same dropout and stochastic-depth masks in every model
    loss = sum(t.square().mean() for t in outputs(model(x)))
    loss.backward()
    return loss.item(), [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def check_train(model: torch.nn.Module, x: torch.Tensor) -> dict:
    original = copy.deepcopy(model).train()
    fast, report = opforge.optimize(copy.deepcopy(model).train(), example_inputs=(x,), report=True)
    loss, grads = _step(original, x)
    _, grads_cl = _step(_channels_last(original), _channels_last(x))
    fast_loss, fast_grads = _step(fast, x)
    exact_loss, exact_grads = _step(copy.deepcopy(model).train().double(), x.double())
    errors = rel_each(fast_grads, exact_grads)
    # The original's own error per parameter: the larger of its NCHW and channels_last runs.
    original_errors = [max(a, b) for a, b in zip(rel_each(grads, exact_grads), rel_each(grads_cl, exact_grads))]
    worst = max(range(len(errors)), key=errors.__getitem__)
    return {
        "worst_parameter": [name for name, _ in model.named_parameters()][worst],
        "worst_parameter_original_vs_float64": original_errors[worst],
        "replaced": len(report.replaced),
        "loss_vs_original": abs(fast_loss - loss) / abs(exact_loss),
        "original_loss_vs_float64": abs(loss - exact_loss) / abs(exact_loss),
        "optimized_loss_vs_float64": abs(fast_loss - exact_loss) / abs(exact_loss),
        "original_vs_float64": max(original_errors),
        "optimized_vs_float64": errors[worst],
    }


def worse(mode: str, r: dict) -> bool:
    """The optimized model is more than twice as far from float64 as the original (plus the floor)."""
    return r["optimized_vs_float64"] > 2 * r["original_vs_float64"] + FLOOR[mode]


def describe(row: dict) -> str:
    """One line: the flag, what was replaced, the errors against float64 beside the original's."""
    nan = float("nan")
    ev, tr = row.get("eval", {}), row.get("train", {})
    return (
        f"{row['model']:24s} {row['flag'][:60]:6s} "
        f"eval {ev.get('replaced', '-')}/{ev.get('layers', '-')} replaced, "
        f"vs f64 {ev.get('optimized_vs_float64', nan):.1e} (original {ev.get('original_vs_float64', nan):.1e}) | "
        f"train {tr.get('replaced', '-')} replaced, "
        f"grads vs f64 {tr.get('optimized_vs_float64', nan):.1e} (original {tr.get('original_vs_float64', nan):.1e})"
        f" | {row['seconds']}s" + (f" | worst: {tr['worst_parameter']}" if row["flag"] == "WORSE" else "")
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated (default: every classification model under --max-params)")
    ap.add_argument("--max-params", type=float, default=64e6, help="skip larger models (default: alexnet in, vgg out)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--image", type=int, default=96, help="input height and width (inception_v3: at least 299)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else torchvision.models.list_models(module=torchvision.models)
    results, bad = [], []
    for name in names:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        row = {"model": name}
        try:
            model = randomized(name, args.max_params)
            if model is None:
                print(f"{name:24s} skipped: more than --max-params {args.max_params:.0f} parameters")
                continue
            image = max(args.image, 299) if name == "inception_v3" else args.image
            x = torch.randn(args.batch, 3, image, image)
            row["eval"] = check_eval(copy.deepcopy(model), x)
            row["train"] = check_train(model, x)
            row["flag"] = "WORSE" if worse("eval", row["eval"]) or worse("train", row["train"]) else "ok"
        except Exception as e:  # a model optimize cannot take is a finding, not the end of the run
            row["flag"] = f"FAILED {type(e).__name__}: {e}"
        row["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(row)
        if row["flag"] != "ok":
            bad.append(name)
        print(describe(row), flush=True)
    print(f"{len(results)} models, {len(bad)} failed or worse than the original: {', '.join(bad) or 'none'}")
    if args.json:
        env = {"torch": torch.__version__, "torchvision": torchvision.__version__, "batch": args.batch}
        with open(args.json, "w") as f:
            json.dump({"environment": env | {"image": args.image}, "results": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
