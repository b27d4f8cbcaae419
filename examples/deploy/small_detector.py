"""A small model for `opforge deploy`: conv2d_3x3 + add_relu + softmax layers and a
detection-style head that ends in nms_padded (a fixed-size output, so it exports).

    opforge deploy examples/deploy/small_detector.py --out deploy --runner
"""

import torch

import opforge


class SmallDetector(torch.nn.Module):
    def __init__(self, classes: int = 5, boxes: int = 64):
        super().__init__()
        self.stem = opforge.nn.Conv2d3x3(3, 16, stride=2, padding=1, activation="relu")
        self.dw = opforge.nn.Conv2d3x3(16, 16, padding=1, groups=16)
        self.add_relu = opforge.nn.AddReLU()
        self.head = torch.nn.Linear(16, classes + 4)
        self.classes, self.boxes = classes, boxes

    def forward(self, x):
        h = self.stem(x)
        h = self.add_relu(self.dw(h), h)  # residual
        feats = h.flatten(2).transpose(1, 2)[:, : self.boxes]  # (N, boxes, 16): one box per position
        out = self.head(feats)
        probs = opforge.softmax(out[..., : self.classes], -1)
        xy = out[..., self.classes : self.classes + 2].sigmoid() * 64
        wh = out[..., self.classes + 2 :].sigmoid() * 32 + 1
        boxes = torch.cat([xy, xy + wh], -1)[0]  # the first image's boxes
        keep, count = opforge.nms_padded(boxes, probs[0].amax(-1), 0.5, 16)
        return probs, keep, count


def model():
    torch.manual_seed(0)
    return SmallDetector().eval()


def example_inputs():
    torch.manual_seed(1)
    return (torch.randn(2, 3, 32, 32),)
