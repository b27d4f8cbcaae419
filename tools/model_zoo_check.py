"""opforge.optimize on torchvision's classification models: outputs and one training step against float64.

Each model is built with random weights (``weights=None``), its BatchNorm
statistics and affine parameters randomized (a fresh model's mean 0 /
variance 1 hides folding bugs), then optimized with ``example_inputs`` as a
user would, once in eval mode and once in training mode, and checked:

- eval: the optimized model's outputs against the original's, and both
  against the original run in float64 (relative to the largest output);
- training: one forward + backward of ``sum of squares' means`` over every
  output (a training googlenet or inception also returns its aux heads),
  with dropout and stochastic depth off (``p = 0``: their masks would be
  drawn in each layout's memory order); the loss and every gradient, paired
  by parameter name, against float64's, relative to the largest float64
  gradient.

Two judgements. The optimized model in float64 against the original in
float64, item by item (each output, the loss, each parameter's gradient):
the same math in other summation orders, so anything beyond ``EXACT``
(1e-9 of the largest) is a wrong formula or a dropped term. In training
that is the model optimize made, converted (``.double()``); in eval, where
BatchNorm is folded into the weights in the model's dtype, a float64 copy
optimized with every layer swapped (``force``). And float32 rounding,
model-wide: the optimized model's worst item against the original's worst
(more than twice as far from float64, plus a floor: 1e-5 of the largest
output or of the loss, 1e-4 of the largest gradient), the original's error
being the larger of its NCHW and channels_last runs', both torch's
float32. Items are listed beyond the original's but not flagged in
float32: a small training batch turns single roundings into ReLU
decisions that move whole gradients (docs/optimize.md, "What the result
supports", has the densenet121 case that showed it).
A model optimize raises on is ``FAILED``, its traceback printed. The exit
status is 1 when any model failed or was flagged.

    python tools/model_zoo_check.py                        # every model up to 64M parameters
    python tools/model_zoo_check.py --models mobilenet_v2,googlenet --json zoo.json
    python tools/model_zoo_check.py --force    # every layer opforge has a kernel for, untimed
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback

import torch
import torchvision

import opforge
from opforge.optimize_layout import has_channels_last_hooks

FLOOR = {"outputs": 1e-5, "loss": 1e-5, "gradients": 1e-4}
# The optimized model in float64 against the original in float64: the same math in other
# summation orders, ~1e-15 apart; a wrong formula or a dropped term is far outside this.
EXACT = 1e-9


def parameter_count(name: str) -> int:
    """The model's size, counted on the meta device (nothing allocated) where it builds there."""
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None, **_extra(name))
    except NotImplementedError:  # a constructor that reads a tensor's value (regnet's block widths)
        model = torchvision.models.get_model(name, weights=None, **_extra(name))
    return sum(p.numel() for p in model.parameters())


def _extra(name: str, image: int = 224) -> dict:
    # googlenet's and inception's init_weights, named: their default warns of a change to come.
    if name in ("googlenet", "inception_v3"):
        return {"init_weights": True}
    # maxvit_t is built for one input size (its attention windows tile the feature maps).
    return {"input_size": (image, image)} if name == "maxvit_t" else {}


def image_size(name: str, image: int) -> int:
    """The input size the model can take nearest above ``image``: inception_v3 needs at least 299, and
    maxvit_t's 7x7 partitions need a multiple of 224 (its last stage runs at 1/32 of the input)."""
    if name == "inception_v3":
        return max(image, 299)
    if name == "maxvit_t":
        return -(-image // 224) * 224
    return image


def randomized(name: str, image: int = 224) -> torch.nn.Module:
    """The model with random BatchNorm state (a fresh model's mean 0 / variance 1 hides folding bugs)
    and no dropout or stochastic depth."""
    model = torchvision.models.get_model(name, weights=None, **_extra(name, image))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, torch.nn.Dropout) or type(m).__name__ == "StochasticDepth":
                m.p = 0.0
    return model


def outputs(y) -> list[torch.Tensor]:
    """A model's tensor outputs (a training googlenet returns a named tuple with aux heads, some None)."""
    return [y] if isinstance(y, torch.Tensor) else [t for t in y if isinstance(t, torch.Tensor)]


def rel_each(a: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Each tensor's largest difference, relative to the largest reference value of them all."""
    scale = max(r.abs().max().item() for r in ref) or 1.0
    return [(x.double() - r.double()).abs().max().item() / scale for x, r in zip(a, ref, strict=True)]


def runs_channels_last(fast: torch.nn.Module) -> bool:
    """Whether optimize made the model (or a part of it) run channels_last inside."""
    return any(has_channels_last_hooks(m) for m in fast.modules())


def _channels_last(m):
    if isinstance(m, torch.Tensor):
        return m.contiguous(memory_format=torch.channels_last)
    return copy.deepcopy(m).to(memory_format=torch.channels_last)


def _baseline(errors: list[float], errors_cl: list[float]) -> list[float]:
    """The original's own error per item: the larger of its two layouts' (see the module's docs)."""
    return [max(a, b) for a, b in zip(errors, errors_cl, strict=True)]


def _compare(what: str, errors: list[float], baseline: list[float], names: list[str], errors64: list[float]) -> dict:
    """The worst float32 item against the original's worst (a model-wide rounding quality: a small
    training batch turns single roundings into ReLU decisions, see the module's docs), and each
    item of the optimized model run in float64 against ``EXACT``."""
    worst = max(range(len(errors)), key=errors.__getitem__)
    beyond = [n for n, e, b in zip(names, errors, baseline, strict=True) if e > 2 * b + FLOOR[what]]
    return {
        f"{what}_vs_float64": errors[worst],
        f"original_{what}_vs_float64": max(baseline),
        f"worst_{what}": names[worst],
        f"float32_{what}_beyond_original": beyond,
        f"{what}_in_float64_vs_float64": max(errors64),
        f"worse_{what}": ([f"float32 {what}"] if errors[worst] > 2 * max(baseline) + FLOOR[what] else [])
        + [f"{n} in float64" for n, e in zip(names, errors64, strict=True) if e > EXACT],
    }


def optimize(model: torch.nn.Module, x: torch.Tensor, force: bool):
    if force:
        return opforge.optimize(model, report=True, force=True)
    return opforge.optimize(model, example_inputs=(x,), report=True)


def check_eval(model: torch.nn.Module, x: torch.Tensor, force: bool = False) -> dict:
    model = model.eval()
    fast, report = optimize(model, x, force)
    cl = runs_channels_last(fast)
    with torch.no_grad():
        ref = outputs(model(x))
        got = outputs(fast(x))
        exact = outputs(copy.deepcopy(model).double()(x.double()))
        ref_cl = outputs(_channels_last(model)(_channels_last(x)))
        got64 = outputs(optimize(copy.deepcopy(model).double(), x.double(), True)[0](x.double()))
    names = [f"output {i}" for i in range(len(exact))]
    baseline = _baseline(rel_each(ref, exact), rel_each(ref_cl, exact))
    return {
        "replaced": len(report.replaced),
        "layers": len(report.layers),
        "channels_last_inside": cl,
        "vs_original": max(rel_each(got, ref)),
        **_compare("outputs", rel_each(got, exact), baseline, names, rel_each(got64, exact)),
    }


def _step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward + backward from zeroed gradients: (the loss, each parameter's gradient by name)."""
    model.zero_grad(set_to_none=True)
    loss = sum(t.square().mean() for t in outputs(model(x)))
    loss.backward()
    return loss.item(), {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def check_train(model: torch.nn.Module, x: torch.Tensor, force: bool = False) -> dict:
    original = copy.deepcopy(model).train()
    fast, report = optimize(copy.deepcopy(model).train(), x, force)
    cl = runs_channels_last(fast)
    loss, grads = _step(original, x)
    fast_loss, fast_grads = _step(fast, x)
    exact_loss, exact_grads = _step(copy.deepcopy(model).train().double(), x.double())
    if not (grads.keys() == fast_grads.keys() == exact_grads.keys()):
        raise RuntimeError("the optimized model's parameter names differ from the original's")
    names = list(exact_grads)
    exact = [exact_grads[n] for n in names]
    loss_cl, grads_cl = _step(_channels_last(original), _channels_last(x))
    loss64, grads64 = _step(copy.deepcopy(fast).double(), x.double())

    def loss_err(v):
        return [abs(v - exact_loss) / abs(exact_loss)]

    return {
        "replaced": len(report.replaced),
        "channels_last_inside": cl,
        "loss_vs_original": abs(fast_loss - loss) / abs(exact_loss),
        **_compare(
            "loss", loss_err(fast_loss), _baseline(loss_err(loss), loss_err(loss_cl)), ["loss"], loss_err(loss64)
        ),
        **_compare(
            "gradients",
            rel_each([fast_grads[n] for n in names], exact),
            _baseline(
                rel_each([grads[n] for n in names], exact),
                rel_each([grads_cl[n] for n in names], exact),
            ),
            names,
            rel_each([grads64[n] for n in names], exact),
        ),
    }


def worse(row: dict) -> list[str]:
    """What of a checked model is more than twice the original's error from float64."""
    return [n for mode in ("eval", "train") for k, v in row.get(mode, {}).items() if k.startswith("worse_") for n in v]


def describe(row: dict) -> str:
    """One line: the flag, what was replaced, the errors against float64 beside the original's."""
    nan = float("nan")
    ev, tr = row.get("eval", {}), row.get("train", {})
    in64 = [m[k] for m, k in ((ev, "outputs_in_float64_vs_float64"), (tr, "gradients_in_float64_vs_float64")) if k in m]
    exact = max(in64, default=nan)
    return (
        f"{row['model']:24s} {row['flag'][:60]:6s} "
        f"eval {ev.get('replaced', '-')}/{ev.get('layers', '-')} replaced, "
        f"vs f64 {ev.get('outputs_vs_float64', nan):.1e} (original {ev.get('original_outputs_vs_float64', nan):.1e}) | "
        f"train {tr.get('replaced', '-')} replaced, "
        f"grads vs f64 {tr.get('gradients_vs_float64', nan):.1e} "
        f"(original {tr.get('original_gradients_vs_float64', nan):.1e}) | "
        f"in float64 {exact:.0e}"
        f" | {row['seconds']}s" + (f" | worse: {', '.join(row['worse'][:3])}" if row.get("worse") else "")
    )


def check_model(name: str, args) -> dict:
    torch.manual_seed(0)
    row = {"model": name, "image": image_size(name, args.image)}
    t0 = time.perf_counter()
    try:
        model = randomized(name, row["image"])
        x = torch.randn(args.batch, 3, row["image"], row["image"])
        row["eval"] = check_eval(copy.deepcopy(model), x, args.force)
        row["train"] = check_train(model, x, args.force)
        row["worse"] = worse(row)
        row["flag"] = "WORSE" if row["worse"] else "ok"
    except Exception as e:  # a model optimize cannot take is a finding: reported, and the run goes on
        traceback.print_exc()
        row["flag"] = f"FAILED {type(e).__name__}: {e}"
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated (default: every classification model under --max-params)")
    ap.add_argument("--max-params", type=float, default=64e6, help="skip larger models (default: alexnet in, vgg out)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument(
        "--image",
        type=int,
        default=96,
        help="input height and width, raised where a model needs it (inception_v3: 299; maxvit_t: a multiple of 224)",
    )
    ap.add_argument("--force", action="store_true", help="swap every layer opforge has a kernel for, untimed")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else torchvision.models.list_models(module=torchvision.models)
    results = []
    for name in names:
        if parameter_count(name) > args.max_params:
            print(f"{name:24s} skipped: more than --max-params {args.max_params:.0f} parameters")
            continue
        results.append(check_model(name, args))
        print(describe(results[-1]), flush=True)
    bad = [r["model"] for r in results if r["flag"] != "ok"]
    print(f"{len(results)} models, {len(bad)} failed or worse than the original: {', '.join(bad) or 'none'}")
    if args.json:
        env = {"torch": torch.__version__, "torchvision": torchvision.__version__, "batch": args.batch}
        with open(args.json, "w") as f:
            json.dump({"environment": env | {"force": args.force}, "results": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
