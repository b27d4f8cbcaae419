"""What ``opforge.optimize(..., report=True)`` returns: a row per layer, what was done and why."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LayerReport:
    conv: str  # the conv's qualified name in the model
    pattern: str  # e.g. "Conv2d(3x3, depthwise) -> BatchNorm2d -> ReLU6"
    action: str  # what optimize did
    reason: str = ""  # why (measured times, or what stopped it)


@dataclasses.dataclass
class OptimizeReport:
    layers: list[LayerReport]
    notes: list[str] = dataclasses.field(default_factory=list)  # model-level choices

    @property
    def replaced(self) -> list[LayerReport]:
        """The layers optimize changed (replaced, fused or folded); the rest run as they were."""
        return [r for r in self.layers if r.action != "left"]

    def __str__(self) -> str:
        lines = [f"model: {note}" for note in self.notes]
        lines.append(f"{'layer':<28} {'pattern':<46} action")
        for r in self.layers:
            lines.append(f"{r.conv:<28} {r.pattern:<46} {r.action}" + (f" ({r.reason})" if r.reason else ""))
        changed = len(self.replaced)
        lines.append(f"{changed} of {len(self.layers)} layers changed, {len(self.layers) - changed} left")
        return "\n".join(lines)
