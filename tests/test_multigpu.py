"""Several GPUs: every op runs on its inputs' device and stream, and a DDP step matches one GPU.

Marked ``multigpu``: skipped (with the reason) on machines with fewer than
two GPUs. The current device is deliberately another GPU than the inputs',
so a kernel that launches on the current device instead of the inputs'
(a missing device guard) gives wrong results or an error here.
"""

import os
import socket

import pytest
import torch
from reference import rand

import opforge

pytestmark = pytest.mark.multigpu


def _boxes(n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    xy = torch.rand(n, 2) * 64
    wh = torch.rand(n, 2) * 24 + 4
    return torch.cat([xy, xy + wh], 1).to(device), torch.rand(n).to(device)


# name -> (make inputs on the CPU, call, differentiable input indices)
CASES = {
    "add": (lambda: [rand((64, 33)), rand((33,))], lambda a, b: opforge.add(a, b), (0, 1)),
    "add_relu": (lambda: [rand((64, 33)), rand((64, 33))], lambda a, b: opforge.add_relu(a, b), (0, 1)),
    "softmax": (lambda: [rand((16, 300))], lambda x: opforge.softmax(x, -1), (0,)),
    "log_softmax": (lambda: [rand((16, 300))], lambda x: opforge.log_softmax(x, 0), (0,)),
    "scaled_masked_softmax": (
        lambda: [rand((2, 4, 16, 16)), torch.rand(16, 16) > 0.7],
        lambda x, m: opforge.scaled_masked_softmax(x, m, 0.25),
        (0,),
    ),
    "conv2d_3x3 dense relu": (
        lambda: [rand((2, 8, 12, 12)), rand((16, 8, 3, 3)), rand((16,))],
        lambda x, w, b: opforge.conv2d_3x3(x, w, b, 1, 1, 1, activation="relu"),
        (0, 1, 2),
    ),
    "conv2d_3x3 depthwise": (
        lambda: [rand((2, 8, 12, 12)), rand((8, 1, 3, 3)), rand((8,))],
        lambda x, w, b: opforge.conv2d_3x3(x, w, b, 2, 1, 8),
        (0, 1, 2),
    ),
    "nms": (lambda: list(_boxes(200, "cpu")), lambda b, s: opforge.nms(b, s, 0.5), ()),
    "batched_nms": (
        lambda: [*_boxes(200, "cpu"), torch.randint(0, 4, (200,))],
        lambda b, s, i: opforge.batched_nms(b, s, i, 0.5),
        (),
    ),
    "nms_padded": (lambda: list(_boxes(200, "cpu")), lambda b, s: opforge.nms_padded(b, s, 0.5, 64), ()),
}


def _run(name, inputs, device):
    _, call, grads = CASES[name]
    args = [t.to(device).requires_grad_(i in grads) for i, t in enumerate(inputs)]
    out = call(*args)
    outs = out if isinstance(out, tuple) else (out,)
    if grads:
        outs[0].float().square().sum().backward()
    return outs, [args[i].grad for i in grads]


@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
@pytest.mark.parametrize("name", CASES)
def test_op_runs_on_its_inputs_device(name, current, target):
    inputs = CASES[name][0]()
    with torch.cuda.device(target):
        expected, expected_grads = _run(name, inputs, f"cuda:{target}")
    with torch.cuda.device(current):
        got, got_grads = _run(name, inputs, f"cuda:{target}")
    for g, e in zip(got + tuple(got_grads), expected + tuple(expected_grads), strict=True):
        assert g.device == torch.device(f"cuda:{target}")
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_op_uses_the_current_stream_of_its_device(name):
    # The producer and the op are queued on a side stream of cuda:1 behind a
    # long kernel; an op on another stream would read its input too early.
    inputs = CASES[name][0]()
    expected, _ = _run(name, inputs, "cuda:1")
    side = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.device(0), torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        args = [t.to("cuda:1", non_blocking=False) for t in inputs]
        out = CASES[name][1](*args)
    side.synchronize()
    outs = out if isinstance(out, tuple) else (out,)
    for g, e in zip(outs, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_inputs_on_two_gpus_raise_the_device_error():
    with pytest.raises(RuntimeError, match=r"must be on the same device, got a on cuda:0 and b on cuda:1"):
        opforge.add_relu(torch.randn(4, device="cuda:0"), torch.randn(4, device="cuda:1"))
    with pytest.raises(RuntimeError, match=r"same device"):
        opforge.conv2d_3x3(torch.randn(1, 4, 8, 8, device="cuda:0"), torch.randn(4, 4, 3, 3, device="cuda:1"))


# --------------------------------------------------------------------------- DistributedDataParallel


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = opforge.nn.Conv2d3x3(3, 16, padding=1, activation="relu")
        self.dw = opforge.nn.Conv2d3x3(16, 16, stride=2, padding=1, groups=16)
        self.add_relu = opforge.nn.AddReLU()
        self.fc = torch.nn.Linear(16, 10)
        self.log_softmax = opforge.nn.LogSoftmax(-1)

    def forward(self, x):
        h = self.dw(self.conv1(x))
        h = self.add_relu(h, h.mean((2, 3), keepdim=True))
        return self.log_softmax(self.fc(h.mean((2, 3))))


def _data(steps: int, batch: int):
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch, 3, 16, 16, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
        for _ in range(steps)
    ]


def _train(model, data, device, rank=0, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        loss = torch.nn.functional.nll_loss(model(x[part].to(device)), y[part].to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _ddp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = SmallNet().to(f"cuda:{rank}")
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    losses = _train(ddp, _data(4, 16), f"cuda:{rank}", rank, world)
    mean_losses = []
    for loss in losses:
        dist.all_reduce(loss)
        mean_losses.append((loss / world).item())
    if rank == 0:
        torch.save({"losses": mean_losses, "state": {k: v.cpu() for k, v in model.state_dict().items()}}, out_path)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_step_matches_one_gpu(tmp_path):
    out_path = str(tmp_path / "ddp.pt")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), out_path), nprocs=2, join=True)
    ddp = torch.load(out_path)
    torch.manual_seed(0)
    single = SmallNet().to("cuda:0")
    losses = [loss.item() for loss in _train(single, _data(4, 16), "cuda:0")]
    # Equal halves of each batch: the mean of the two ranks' losses is the full batch's loss.
    torch.testing.assert_close(torch.tensor(ddp["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for k, v in single.state_dict().items():
        torch.testing.assert_close(ddp["state"][k], v.cpu(), rtol=1e-4, atol=1e-5)
